#ifndef _GNU_SOURCE
#define _GNU_SOURCE  // mkostemp
#endif

#include "safe-file.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void safe_file_free(struct safe_file * sf) {
    free(sf->tmp);
    free(sf->path);
    *sf = (struct safe_file) {0};
}

// The file path names once links are followed (also a link to a file not there yet), malloc'ed.
static char * safe_file_target(const char * path) {
    char * cur = strdup(path);
    for (int hops = 0; cur != NULL && hops < 40; hops++) {
        char link[PATH_MAX];
        const ssize_t n = readlink(cur, link, sizeof(link) - 1);
        if (n <= 0) {
            return cur;
        }
        link[n] = '\0';
        char * folder = strdup(cur);
        char * next = NULL;
        if (folder != NULL && (next = malloc(strlen(folder) + (size_t) n + 2)) != NULL) {
            sprintf(next, "%s/%s", link[0] == '/' ? "" : dirname(folder), link);  // relative: to the link's folder
        }
        free(folder);
        free(cur);
        cur = next;
    }
    return cur;
}

bool safe_file_open(struct safe_file * sf, const char * path) {
    *sf = (struct safe_file) {0};
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        sf->f = fopen(path, "wb");
        return sf->f != NULL;
    }
    sf->path = safe_file_target(path);
    const size_t len = sf->path != NULL ? strlen(sf->path) : 0;
    sf->tmp = malloc(len + sizeof(".tmp-XXXXXX"));
    if (sf->path == NULL || sf->tmp == NULL) {
        safe_file_free(sf);
        errno = ENOMEM;
        return false;
    }
    memcpy(sf->tmp, sf->path, len);
    memcpy(sf->tmp + len, ".tmp-XXXXXX", sizeof(".tmp-XXXXXX"));
    const int fd = mkostemp(sf->tmp, O_CLOEXEC);
    if (fd < 0) {
        const int err = errno;
        safe_file_free(sf);
        errno = err;
        return false;
    }
    // mkostemp makes the file private (0600); the target gets what a plain fopen would give it
    const mode_t mask = umask(0);
    umask(mask);
    if (fchmod(fd, 0666 & ~mask) != 0 || (sf->f = fdopen(fd, "wb")) == NULL) {
        const int err = errno;
        close(fd);
        unlink(sf->tmp);
        safe_file_free(sf);
        errno = err;
        return false;
    }
    return true;
}

// fsync of the folder that holds path, so that the rename itself is on the disk.
static bool safe_file_sync_folder(const char * path) {
    char * copy = strdup(path);
    if (copy == NULL) {
        errno = ENOMEM;
        return false;
    }
    const int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    free(copy);
    if (fd < 0) {
        return false;
    }
    const bool ok = fsync(fd) == 0 || errno == EINVAL;  // EINVAL: a file system without folder sync
    const int err = errno;
    close(fd);
    errno = err;
    return ok;
}

bool safe_file_commit(struct safe_file * sf) {
    if (sf->tmp == NULL) {  // not a regular file: nothing to sync or rename
        const bool ok = fclose(sf->f) == 0;
        const int err = errno;
        safe_file_free(sf);
        errno = err;
        return ok;
    }
    bool ok = fflush(sf->f) == 0 && fsync(fileno(sf->f)) == 0;
    int err = errno;
    if (fclose(sf->f) != 0 && ok) {
        ok = false;
        err = errno;
    }
    if (ok && rename(sf->tmp, sf->path) != 0) {
        ok = false;
        err = errno;
    }
    if (!ok) {
        unlink(sf->tmp);
    } else if (!safe_file_sync_folder(sf->path)) {
        ok = false;  // renamed, but not known to be on the disk
        err = errno;
    }
    safe_file_free(sf);
    errno = err;
    return ok;
}

void safe_file_discard(struct safe_file * sf) {
    if (sf->f != NULL) {
        fclose(sf->f);
    }
    if (sf->f != NULL && sf->tmp != NULL) {
        unlink(sf->tmp);
    }
    safe_file_free(sf);
}
