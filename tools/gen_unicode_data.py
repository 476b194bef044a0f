#!/usr/bin/env python3
"""Writes src/unicode-data.c: the Unicode character classes the tokenizer pre-splitters use.

Usage: python3 tools/gen_unicode_data.py [OUTPUT]   (default: src/unicode-data.c)

The table is a sorted list of ranges covering U+0000..U+10FFFF; each entry packs the first
code point of a range and its flags as (start << 10) | flags, so a lookup is one binary search;
Latin-1, most of what is tokenized, also gets a direct table.
Flags: the major general category (L, N, M, P, S, Z, C; from Python's unicodedata), the
letter cases the case-aware regexes tell apart (Ll; Lu or Lt), plus White_Space, which
unicodedata does not expose: its list below is PropList.txt's, unchanged since Unicode 6.3
(str.isspace() is not it: that also counts U+001C..U+001F).
"""
from __future__ import annotations

import sys
import unicodedata
from pathlib import Path

FLAGS = {"L": 0x01, "N": 0x02, "M": 0x04, "P": 0x08, "S": 0x10, "Z": 0x20, "C": 0x40}
WHITESPACE_FLAG = 0x80
CASE_FLAGS = {"Ll": 0x100, "Lu": 0x200, "Lt": 0x200}
FLAG_BITS = 10
WHITE_SPACE = [(0x0009, 0x000D), (0x0020, 0x0020), (0x0085, 0x0085), (0x00A0, 0x00A0),
               (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F),
               (0x205F, 0x205F), (0x3000, 0x3000)]
MAX_CPT = 0x110000


def cpt_flags() -> list[int]:
    cats = [unicodedata.category(chr(c)) for c in range(MAX_CPT)]
    flags = [FLAGS[cat[0]] | CASE_FLAGS.get(cat, 0) for cat in cats]
    for lo, hi in WHITE_SPACE:
        for c in range(lo, hi + 1):
            flags[c] |= WHITESPACE_FLAG
    return flags


def ranges(flags: list[int]) -> list[tuple[int, int]]:
    out = []
    for c, f in enumerate(flags):
        if not out or out[-1][1] != f:
            out.append((c, f))
    return out


def render(rs: list[tuple[int, int]], flags: list[int]) -> str:
    lines = [
        f"// Unicode character classes by range: (first code point << {FLAG_BITS}) | flags, sorted.",
        f"// Written by tools/gen_unicode_data.py from Python {sys.version_info.major}."
        f"{sys.version_info.minor}'s unicodedata, Unicode {unicodedata.unidata_version}."
        " Do not edit: rerun the script.",
        '#include "unicode.h"',
        "",
        f'const char unicode_data_version[] = "{unicodedata.unidata_version}";',
        "",
        "const uint32_t unicode_flag_ranges[] = {",
    ]
    row = []
    for start, f in rs:
        row.append(f"0x{(start << FLAG_BITS) | f:08X},")
        if len(row) == 8:
            lines.append("    " + " ".join(row))
            row = []
    if row:
        lines.append("    " + " ".join(row))
    lines += [
        "};",
        "",
        "const size_t unicode_flag_ranges_n = sizeof(unicode_flag_ranges) / sizeof(unicode_flag_ranges[0]);",
        "",
        "// The same flags for U+0000..U+00FF, looked up directly.",
        "const uint16_t unicode_flags_latin1[256] = {",
    ]
    for i in range(0, 256, 16):
        lines.append("    " + " ".join(f"0x{f:03X}," for f in flags[i:i + 16]))
    lines += ["};", ""]
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "src" / "unicode-data.c"
    flags = cpt_flags()
    rs = ranges(flags)
    out.write_text(render(rs, flags))
    print(f"{out}: {len(rs)} ranges, Unicode {unicodedata.unidata_version}")


if __name__ == "__main__":
    main()
