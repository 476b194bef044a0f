// A file replaced whole or not at all: the new content goes to a temporary file in the same
// folder, is flushed to the disk (fsync), then renamed over the target, and the folder is
// flushed too. A crash or kill -9 before the rename leaves the previous file as it was (and
// a "FILE.tmp-XXXXXX" beside it); no reader ever sees half of the new one. A link is followed
// (the file it names is replaced, the link stays); a target that exists and is not a regular
// file (/dev/null, a pipe) is written as it is: there is no file to replace.
#pragma once

#include <stdbool.h>
#include <stdio.h>

struct safe_file {
    FILE * f;    // write the content here
    char * tmp;  // the temporary file's path; NULL when the target is written as it is
    char * path;
};

// Opens the temporary file for writing; false with errno set.
bool safe_file_open(struct safe_file * sf, const char * path);
// Flushes, syncs and renames the temporary file over the target; false with errno set (the
// temporary file is then removed and the target left as it was). Frees sf either way.
bool safe_file_commit(struct safe_file * sf);
// Removes the temporary file and frees sf (a run that failed); nothing if it was not opened.
void safe_file_discard(struct safe_file * sf);
