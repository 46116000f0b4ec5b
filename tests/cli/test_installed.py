"""`pdserve` as installed from its wheel, run from outside the checkout (tests/cli/installed.py)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

from pdserve.cli.main import COMMANDS
from tests.cli.installed import REPO, Installed, build_wheel, install, repository_files, wheel_files
from tests.cli.up_platform import running_up, up_ports

# longer than the tiny Qwen3's 24-token window (38 tokens): the window slides within the prompt
PROMPT = ("The quick brown fox jumps over the lazy dog while the old grey cat sleeps in the warm sun "
          "beside the river, and far away a small bird sings a song about the long summer days")
MAX_TOKENS = 8
NOT_INSTALLED = {"tests", "bench"}   # the repository's own tooling, never imported by the product


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("installed")
    return install(build_wheel(root / "dist"), root / "venv", root / "work")


def imported_packages() -> set[str]:
    """The repository's folders installed as pdserve's subpackages that the tests or the CLI's
    commands import (`pdserve.engine.llm` -> `engine`)."""
    names = {c.module.split(".")[1] for c in _commands(COMMANDS)}
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                dotted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                dotted = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            names.update(d.split(".")[1] for d in dotted if d.startswith("pdserve."))
    return {n for n in names if (REPO / n / "__init__.py").is_file()} - NOT_INSTALLED


def _commands(commands):
    for c in commands:
        yield from _commands(c.subcommands) if c.subcommands else (c,)


def test_the_wheel_holds_every_runtime_file_of_the_repository(installed):
    packages = imported_packages()
    assert {"engine", "kernels", "services", "cli", "sim"} <= packages
    expected = {f"pdserve/{name}" for name in repository_files("pdserve", *sorted(packages))
                if not name.startswith("pdserve/")} | {"pdserve/__init__.py"}
    assert {"pdserve/kernels/cpu/paged_attention.cpp", "pdserve/sim/profiles/h100_llama8b.json",
            "pdserve/autoscale/chart_values.yaml"} <= expected
    missing = sorted(expected - wheel_files(installed.wheel))
    assert missing == [], f"files the product needs that the wheel lacks: {missing}"


def test_the_wheel_installs_one_top_level_package_pdserve(installed):
    # every peer installs one name (vllm, sglang, dynamo); generic ones (engine, kernels, cli)
    # collide with other distributions' packages in site-packages
    assert {name.split("/")[0] for name in wheel_files(installed.wheel)} == {"pdserve"}
    with zipfile.ZipFile(installed.wheel) as z:
        top_level = [n for n in z.namelist() if n.endswith(".dist-info/top_level.txt")]
        assert all(z.read(n).decode().split() == ["pdserve"] for n in top_level)


def test_the_wheel_carries_the_charts_values_themselves_not_a_link(installed):
    with zipfile.ZipFile(installed.wheel) as z:
        carried = z.read("pdserve/autoscale/chart_values.yaml")
    assert carried == (REPO / "deploy" / "helm" / "pdserve" / "values.yaml").read_bytes()


def test_pdserve_help_works_from_any_directory_and_loads_no_torch(installed):
    out = installed.run("--help")
    assert out.returncode == 0, out.stderr
    assert all(c.name in out.stdout for c in COMMANDS)
    probe = ("import sys\nfrom pdserve.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('torch', 'grpc', 'fastapi', 'transformers') if m in sys.modules), "
             "file=sys.stderr)")
    loaded = installed.run_python(probe, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stderr.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("words", [[c.name] for c in COMMANDS if not c.subcommands]
                         + [[c.name, s.name] for c in COMMANDS for s in c.subcommands])
def test_every_subcommands_help_works_installed(installed, words):
    out = installed.run(*words, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: pdserve {' '.join(words)}")


def test_a_command_whose_module_cannot_import_fails_alone_naming_it(installed):
    # `sim` missing, as when it was left out of the packages: its commands fail in one line
    # that names it, and the others still work in the same process
    probe = ("import importlib.abc, sys\n"
             "class Missing(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'pdserve.sim':\n"
             "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
             "sys.meta_path.insert(0, Missing())\n"
             "from pdserve.cli.main import main\n"
             "print(main(['profile', '--help']))\n"
             "try:\n    main(['up', '--help'])\nexcept SystemExit as e:\n    print('up', e.code)\n")
    out = installed.run_python(probe)
    lines = out.stdout.splitlines()
    assert (lines[0], lines[1].startswith("usage: pdserve up "), lines[-1]) == ("2", True, "up 0"), out.stdout
    (error,) = out.stderr.strip().splitlines()
    assert error == ("pdserve: error: 'pdserve profile' is unavailable: module 'pdserve.sim' could not be "
                     "imported while loading pdserve.profiler.measure (No module named 'pdserve.sim')")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    """A new architecture as users bring one (bench/tiny_checkpoints.py: sliding window of
    24 tokens, q/k norms, YaRN RoPE)."""
    from bench.tiny_checkpoints import build_tiny_checkpoint
    from tests.models import smollm2_tokenizer
    return build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("models") / "tiny-qwen3", smollm2_tokenizer())


@pytest.fixture(scope="module")
def generated(installed, tiny_qwen3, tmp_path_factory) -> dict:
    """`pdserve generate` with the default backend: the C++ kernels built from the wheel's
    own source, in an extension cache of their own (nothing built from the checkout reused)."""
    cache = tmp_path_factory.mktemp("torch-extensions")
    out = installed.run("generate", "--model", tiny_qwen3, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS),
                        "--json", timeout=600, TORCH_EXTENSIONS_DIR=str(cache))
    assert out.returncode == 0, out.stderr
    built = list(cache.rglob("pdserve_cpu_kernels*.so"))
    assert built, f"the cpu backend built no kernels under {cache}"
    return json.loads(out.stdout)


def test_generate_installed_with_the_default_cpu_backend_matches_transformers(generated, tiny_qwen3):
    from tests.engine.hf_reference import hf_greedy, load_hf_model
    from transformers import AutoTokenizer
    eos = {AutoTokenizer.from_pretrained(tiny_qwen3).eos_token_id}
    assert len(generated["prompt_token_ids"]) == 38
    (expected,) = hf_greedy(load_hf_model(tiny_qwen3), [generated["prompt_token_ids"]], MAX_TOKENS, eos)
    assert generated["token_ids"] == expected and len(expected) == MAX_TOKENS


# Hugging Face's `kernels` and its one dependency the test environment lacks (`make setup`)
HF_KERNELS_WHEELS = Path(sys.prefix) / "hf-kernels-wheels"


def test_pdserve_works_beside_hugging_faces_kernels_package(installed, generated, tiny_qwen3, tmp_path):
    """Both in one site-packages, as `pip install pdserve kernels` leaves them: transformers takes
    up Hugging Face's `kernels`, pdserve's own are pdserve.kernels, and generate answers as before."""
    wheels = sorted(HF_KERNELS_WHEELS.glob("*.whl"))
    assert any(w.name.startswith("kernels-") for w in wheels), f"no kernels wheel in {HF_KERNELS_WHEELS}: make setup"
    beside = install(installed.wheel, tmp_path / "venv", tmp_path / "work")
    subprocess.run([beside.python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", *map(str, wheels)],
                   check=True, timeout=300)
    probe = ("import kernels, pdserve.kernels.cpu\n"
             "from transformers.utils.import_utils import is_kernels_available\n"
             "print(kernels.__file__, hasattr(kernels, 'get_kernel'), is_kernels_available(), pdserve.kernels.cpu.__file__)")
    out = beside.run_python(probe)
    assert out.returncode == 0, out.stderr
    theirs, has_get_kernel, available, ours = out.stdout.split()
    site = str(beside.prefix)
    assert theirs.startswith(site) and "/site-packages/kernels/" in theirs
    assert (has_get_kernel, available) == ("True", "True")
    assert ours.startswith(site) and ours.endswith("/site-packages/pdserve/kernels/cpu/__init__.py")
    run = beside.run("generate", "--model", tiny_qwen3, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS),
                     "--json", timeout=600)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["token_ids"] == generated["token_ids"]


def _completion(port: int, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_up_installed_serves_a_request_through_the_router_and_stops_on_ctrl_c(installed, generated, tiny_qwen3,
                                                                             tmp_path):
    """`pdserve up --model <a Qwen3 folder>`: both requests (gRPC through `pdserve generate
    --url`, and OpenAI HTTP) go prefill -> kvstore -> decode and answer as the offline engine."""
    ports = up_ports(2, http=True)
    # the threshold policy at 4 tokens sends the prompt through the prefill worker (the
    # default adaptive policy would prefill 38 tokens on the decode worker itself)
    with running_up(tiny_qwen3, ports, ["--path-policy", "threshold", "--short-prompt-tokens", "4"], tmp_path,
                    pdserve=(installed.pdserve,), cwd=installed.workdir, env=installed.env()) as up:
        out = installed.run("generate", "--url", up.router, "--model", tiny_qwen3, "--prompt", PROMPT,
                            "--max-tokens", str(MAX_TOKENS), "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["token_ids"] == generated["token_ids"]
        answer = _completion(ports["http"], tiny_qwen3)
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/v1/models", timeout=10).read())
        assert models["object"] == "list" and models["data"]
        prefilled = up.metric(1, "pdserve_prefill_tokens_total")
        imported = up.metric(2, "pdserve_kvstore_imported_tokens_total")
        decode_cached = up.metric(2, "vllm:prefix_cache_hits_total", f'{{engine="0",model_name="{tiny_qwen3}"}}')
    (choice,) = answer["choices"]
    assert choice["text"] == generated["text"]
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (38, MAX_TOKENS)
    # both requests were prefilled by the prefill worker; the decode worker read the first's KV
    # whole, and of the second only what follows the blocks it holds from the first
    assert prefilled == 2 * 38
    assert decode_cached > 0 and imported + decode_cached == 2 * 38
    log = "".join(up.lines)
    for name in ("kvstore", "prefill-0", "decode-0", "router"):   # every process's log, prefixed
        assert f"[{name:>9}]" in log
    assert up.proc.returncode == 0, log
