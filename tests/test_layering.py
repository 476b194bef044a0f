"""The layering of docs/DESIGN.md section 1, read from the #include lines of every C file.

Each quoted include is resolved to the file it names (beside the includer, else in the folders
the build gives that layer); the assertions are on where the included file lives.
"""
from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
LAYERS = ["ggml_innerq", "cpu", "cuda", "src", "tools"]
# where a quoted include is looked up, after the includer's own folder (CMakeLists.txt)
SEARCH = {"ggml_innerq": ["ggml_innerq"], "cpu": ["ggml_innerq", "cpu"], "cuda": ["ggml_innerq", "cuda"],
          "src": ["ggml_innerq", "cpu", "cuda", "src"], "tools": ["tools/common", "src", "ggml_innerq"]}


def c_files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".c", ".h", ".cu", ".cuh"))


def includes(path: Path) -> list[Path]:
    """The repository files path includes; an include found nowhere is an error."""
    layer = path.relative_to(ROOT).parts[0]
    out = []
    for name in INCLUDE.findall(path.read_text(encoding="utf-8", errors="replace")):
        candidates = [path.parent / name] + [ROOT / d / name for d in SEARCH[layer]]
        found = next((c.resolve() for c in candidates if c.is_file()), None)
        assert found is not None, f"{path.relative_to(ROOT)} includes {name!r}, which is not in the repository"
        out.append(found)
    return out


def folder_of(path: Path) -> str:
    return path.relative_to(ROOT).parent.as_posix()


def test_every_layer_has_files():
    for layer in ("ggml_innerq", "cpu", "src", "tools"):
        assert c_files(layer), layer


def test_tensor_library_includes_only_itself():
    for f in c_files("ggml_innerq"):
        for inc in includes(f):
            assert folder_of(inc) == "ggml_innerq", (f.name, inc)


def test_backends_include_only_the_tensor_library_and_themselves():
    for backend in ("cpu", "cuda"):
        for f in c_files(backend):
            for inc in includes(f):
                top = folder_of(inc).split("/")[0]  # a backend's own subfolders (cpu/x86, cpu/arm) count as it
                assert top in ("ggml_innerq", backend), (f.relative_to(ROOT), inc.relative_to(ROOT))


def test_runtime_includes_no_tool_and_only_the_backends_entry():
    """src/ reaches a backend only through its one entry header (src/device.c picks one)."""
    for f in c_files("src"):
        for inc in includes(f):
            rel = inc.relative_to(ROOT).as_posix()
            assert folder_of(inc) in ("src", "ggml_innerq") or rel in ("cpu/iq-cpu.h", "cuda/iq-cuda.h"), (f.name, rel)


def test_no_include_circle_in_src():
    """Files of one module (x.c, x.h and its private x-impl.h) are one node; an edge is an
    include of another module's header. The graph must have no cycle."""
    def module(p: Path) -> str:
        return p.stem[:-len("-impl")] if p.stem.endswith("-impl") else p.stem

    graph: dict[str, set[str]] = {}
    for f in c_files("src"):
        deps = graph.setdefault(module(f), set())
        deps.update(module(i) for i in includes(f) if folder_of(i) == "src" and module(i) != module(f))
    done, path = set(), []

    def visit(m: str) -> None:
        if m in path:
            raise AssertionError("include circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for d in sorted(graph.get(m, ())):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_nothing_below_includes_tools():
    for layer in ("ggml_innerq", "cpu", "cuda", "src"):
        for f in c_files(layer):
            for inc in includes(f):
                assert not folder_of(inc).startswith("tools"), (f.relative_to(ROOT), inc.relative_to(ROOT))


def test_python_knows_only_the_public_header():
    """The package reads innerq.h and no other C header, and names no internal symbol."""
    for f in sorted((ROOT / "python" / "innerq").glob("*.py")):
        text = f.read_text(encoding="utf-8")
        headers = set(re.findall(r"[\w-]+\.h\b", text))
        assert headers <= {"innerq.h"}, (f.name, headers)
        calls = set(re.findall(r"\blib\.(\w+)", text))
        assert all(c.startswith(("innerq_", "INNERQ_")) for c in calls), (f.name, calls)


def test_runtime_names_devices_not_a_gpu_flag():
    """The device registry (src/device.h) says where a layer runs: no `bool gpu` in src/, and no
    INNERQ_CUDA_* switch between kernel variants in the shipped backend."""
    for f in c_files("src"):
        assert not re.search(r"\bbool\s+gpu\b", f.read_text(encoding="utf-8")), f.name
    for f in c_files("cuda"):
        assert not re.search(r"\bINNERQ_CUDA_[A-Z]", f.read_text(encoding="utf-8")), f.name
