"""One set of defaults (docs/DEFAULTS.md): the C library's, as the table lists them, as the C
tools print them in --help, as `innerq run|chat` and Llama use them."""
from __future__ import annotations

import inspect
import re
import subprocess

import pytest

import tiny_model
from conftest import ROOT, lib_path, tool_path

DOC = ROOT / "docs" / "DEFAULTS.md"


@pytest.fixture(scope="module")
def c_defaults(library) -> dict:
    from innerq._native import defaults

    return defaults()


@pytest.fixture(scope="module")
def library():
    mp = pytest.MonkeyPatch()
    mp.setenv("INNERQ_LIB", lib_path())  # the library under test, not an installed one
    yield mp
    mp.undo()


def table() -> dict[str, str]:
    """key -> the "default" cell of docs/DEFAULTS.md."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] not in ("key", "---"):
            rows[cells[0]] = cells[1]
    return rows


def as_cell(value) -> str:
    """How the table writes a value: its first word."""
    if value is None:
        return "innerq"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_table_is_the_c_defaults(c_defaults):
    rows = table()
    assert set(rows) == set(c_defaults), set(rows) ^ set(c_defaults)
    for key, value in c_defaults.items():
        first = rows[key].split()[0]
        if isinstance(value, float):
            assert float(first) == pytest.approx(value), key
        else:
            assert first == as_cell(value), (key, rows[key], value)


def test_llama_uses_the_c_defaults(c_defaults):
    from innerq import Llama

    init = inspect.signature(Llama.__init__).parameters
    for key in ("n_ctx", "n_batch", "kv_type", "kv_group", "kv_sink", "kv_recent", "kv_hybrid", "kv_norm",
                "kv_debias", "kv_norm_pairs", "kv_rot", "kv_search", "kv_bits", "n_gpu_layers", "use_mmap",
                "kv_rewind_exact"):
        assert init[key].default == c_defaults[key], key
    # None: the C default (the CPUs this process may use; the clock)
    assert init["n_threads"].default is None and c_defaults["n_threads"] == 0
    assert init["seed"].default is None and c_defaults["seed"] == -1
    # innerq's own text generation, generate("text", ...), uses the library's defaults
    from innerq.llama import TEXT_DEFAULTS

    assert TEXT_DEFAULTS == {"max_tokens": c_defaults["n_predict"], "temperature": c_defaults["temperature"],
                             "repeat_last_n": c_defaults["repeat_last_n"]}
    params = inspect.signature(Llama.generate).parameters
    for arg in ("top_k", "top_p", "min_p", "repeat_penalty"):  # shared by both forms of generate
        assert params[arg].default == c_defaults[arg], arg


def lcp_table() -> dict[str, dict[str, str]]:
    """method -> {argument: default} of the llama-cpp-python table of docs/DEFAULTS.md."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Llama's llama-cpp-python methods"):]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|")]
    head, body = rows[0], rows[2:]
    return {row[0].strip("`"): dict(zip(head[1:], row[1:])) for row in body}


def test_llama_cpp_python_methods_keep_its_defaults():
    """The one deliberate exception: Llama's llama-cpp-python-shaped methods default as
    llama-cpp-python 0.3.x does, so that a script written for it gives the same result."""
    from innerq import Llama

    table = lcp_table()
    assert set(table) == {"create_completion", "__call__", "create_chat_completion", "generate", "sample"}
    for method, row in table.items():
        params = inspect.signature(getattr(Llama, method)).parameters
        for arg, cell in row.items():
            if cell == "—":
                assert arg not in params or method == "generate", (method, arg)
                continue
            expected = None if cell == "None" else float(cell)
            assert params[arg].default == expected, (method, arg, params[arg].default, cell)


def test_cli_keeps_the_c_defaults_for_chat(c_defaults):
    """innerq run / chat pass the library's defaults to the chat completion, whose own defaults
    are llama-cpp-python's."""
    from innerq import cli

    args = cli.build_parser().parse_args(["chat"])
    assert cli._sampling(args) == {"max_tokens": c_defaults["n_predict"], "temperature": c_defaults["temperature"],
                                   "top_k": c_defaults["top_k"], "top_p": c_defaults["top_p"],
                                   "min_p": c_defaults["min_p"], "repeat_penalty": c_defaults["repeat_penalty"],
                                   "stop": []}

def help_text(tool: str) -> str:
    res = subprocess.run([tool_path(tool), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def flag_default(text: str, flag: str) -> str:
    """The value after "default" on the help line of flag."""
    line = next(ln for ln in text.splitlines() if re.match(rf"\s+(-\w+, )?{re.escape(flag)}(?![\w-])", ln))
    m = re.search(r"[(;] ?default ([^;:,)\s]+)", line)
    assert m, line
    return m.group(1)


CLI_FLAGS = {"-n": "n_predict", "-c": "n_ctx", "-b": "n_batch", "-t": "n_threads", "--temp": "temperature",
             "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p", "--repeat-penalty": "repeat_penalty",
             "--repeat-last-n": "repeat_last_n", "--seed": "seed", "--kv": "kv_type", "--kv-group": "kv_group",
             "--kv-sink": "kv_sink", "--kv-recent": "kv_recent"}
TOOL_FLAGS = {"innerq-cli": CLI_FLAGS,
              "innerq-bench": {"-t": "n_threads", "-b": "n_batch", "--kv": "kv_type", "--kv-group": "kv_group"},
              "innerq-perplexity": {"-c": "n_ctx", "-b": "n_batch", "-t": "n_threads", "--kv": "kv_type",
                                    "--kv-sink": "kv_sink"}}
CACHE_FLAGS = ["--kv", "--kv-k", "--kv-v", "--kv-group", "--kv-sink", "--kv-recent", "--no-kv-hybrid", "--no-kv-norm",
               "--no-kv-debias", "--no-kv-norm-pairs", "--kv-bits"]


@pytest.mark.parametrize("tool", sorted(TOOL_FLAGS))
def test_c_tools_print_the_c_defaults(c_defaults, tool):
    text = help_text(tool)
    for flag, key in TOOL_FLAGS[tool].items():
        shown = flag_default(text, flag)
        if isinstance(c_defaults[key], float):
            assert float(shown) == pytest.approx(c_defaults[key]), (flag, shown)
        else:
            assert shown == as_cell(c_defaults[key]), (tool, flag, shown)
    for flag in CACHE_FLAGS:
        assert re.search(rf"^\s+{flag}\b", text, re.M), (tool, flag)


@pytest.mark.parametrize("command", ["run", "chat"])
def test_innerq_command_prints_and_passes_the_c_defaults(c_defaults, command):
    from innerq import cli

    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices[command]
    helps = {flag: action.help or "" for action in sub._actions for flag in action.option_strings}
    flags = {f: k for f, k in CLI_FLAGS.items() if f not in ("--repeat-last-n",)}
    for flag, key in flags.items():
        m = re.search(r"default ([^;:,)\s]+)", helps[flag])
        assert m, (flag, helps[flag])
        if isinstance(c_defaults[key], float):
            assert float(m.group(1)) == pytest.approx(c_defaults[key]), (flag, helps[flag])
        else:
            assert m.group(1) == as_cell(c_defaults[key]), (command, flag, helps[flag])
    assert set(CACHE_FLAGS) <= set(helps)
    # without flags nothing is overridden: Llama and its methods apply the library's defaults
    args = cli.build_parser().parse_args([command])
    assert cli._given(args, cli._LLAMA_ARGS) == {} and cli._given(args, cli._SAMPLING_ARGS) == {}
    assert cli._max_tokens(args) == c_defaults["n_predict"]


def test_kv_types_lists_the_default_preset(c_defaults):
    import innerq

    names = innerq.kv_types()
    assert names[0] == "innerq" and {"innerq2", "innerq3", "innerq4", "innerq5", "f16", "kivi2"} <= set(names)
    assert not {"iq2", "iq3", "iq4"} & set(names)  # old names: accepted, not listed


# ---- cache arguments: checked before any model is read ----

BAD_CACHE = [(["--kv", "bogus"], "unknown KV cache type 'bogus'"),
             (["--kv-group", "48"], "kv_group = 48"),
             (["--kv-k", "innerq3", "--kv-v", "f16"], "must both be quantized")]


@pytest.mark.parametrize("tool", ["innerq-cli", "innerq-bench", "innerq-perplexity"])
@pytest.mark.parametrize("flags, needle", BAD_CACHE)
def test_c_tools_reject_a_bad_cache_before_loading(tmp_path, tool, flags, needle):
    """The model path does not exist: an error about it would mean the model was opened first."""
    res = subprocess.run([tool_path(tool), "-m", tmp_path / "absent.gguf", "-f", tmp_path / "absent.txt", *flags]
                         if tool == "innerq-perplexity" else [tool_path(tool), "-m", tmp_path / "absent.gguf", *flags],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and "absent" not in res.stderr, res.stderr


@pytest.mark.parametrize("flags, needle", BAD_CACHE)
def test_python_rejects_a_bad_cache_before_loading(c_defaults, tmp_path, flags, needle):
    from innerq import InvalidArgumentError, Llama, UnsupportedError, cli

    args = cli.build_parser().parse_args(["run", str(tmp_path / "absent.gguf"), *flags])
    with pytest.raises((InvalidArgumentError, UnsupportedError), match=needle.replace("'", ".")):
        Llama(tmp_path / "absent.gguf", **cli._given(args, cli._LLAMA_ARGS))


def test_old_cache_names_are_aliases(c_defaults, tmp_path):
    """iq2 / iq3 / iq4 (release 0.1) name innerq2 / innerq3 / innerq4 until 0.3: the same cache."""
    from innerq import Model

    model = tiny_model.write_tiny_model(tmp_path / "tiny.gguf", tiny_model.TinyConfig(head_dim=64))
    with Model(model) as m:
        for bits in (2, 3, 4):
            assert m.kv_bytes_per_token(f"iq{bits}", "iq2") == m.kv_bytes_per_token(f"innerq{bits}", "innerq2")
        assert m.kv_bytes_per_token("innerq", "innerq") == m.kv_bytes_per_token("innerq3", "innerq2")
