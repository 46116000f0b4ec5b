"""`pdserve up --revision --gpu-memory-utilization --served-model-name --chat-template`: checked
before anything starts, then on the command lines of the processes that take them, which
their own parsers accept; and `pdserve generate --chat --chat-template`."""
from __future__ import annotations

import json
import os

import pytest

import pdserve.cli.main
import pdserve.cli.up
from pdserve.cli.launcher import PlatformConfig, plan
from pdserve.services.router.main import config_from_args
from pdserve.services.worker.config import worker_config_from_args

TEMPLATE = "<<T>>{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}:{% endif %}"
PARSER = pdserve.cli.main.build_parser()


def _planned(monkeypatch, *argv: str) -> dict[str, list[str]]:
    seen: list[PlatformConfig] = []
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: seen.append(cfg) or 0)
    assert pdserve.cli.main.main(["up", *argv]) == 0
    return {s.name: s.argv[s.argv.index("pdserve.cli.main") + 1:] for s in plan(seen[0], [0, 1, 2])}


@pytest.fixture
def template_file(tmp_path) -> str:
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    return "chat.jinja"


def test_the_flags_reach_the_processes_that_take_them(monkeypatch, tmp_path, template_file):
    monkeypatch.chdir(tmp_path)
    specs = _planned(monkeypatch, "--model", "org/name", "--revision", "v1", "--gpu-memory-utilization", "0.5",
                     "--served-model-name", "a", "b", "--chat-template", template_file)
    for name in ("prefill-0", "decode-0"):
        args = PARSER.parse_args(specs[name])
        assert (args.model, args.revision, args.gpu_memory_utilization) == ("org/name", "v1", 0.5)
        assert worker_config_from_args(args).served_name == "a"  # the vllm: metrics' model_name
    router = config_from_args(PARSER.parse_args(specs["router"]))
    assert (router.model, router.revision, router.served_model_names) == ("org/name", "v1", ("a", "b"))
    assert router.chat_template == str(tmp_path / "chat.jinja")  # absolute: the router may run elsewhere


def test_defaults(monkeypatch):
    specs = _planned(monkeypatch)
    for name in ("prefill-0", "decode-0"):
        args = PARSER.parse_args(specs[name])
        assert (args.revision, args.gpu_memory_utilization) == (None, 0.9)
        assert worker_config_from_args(args).served_name == args.model
    router = config_from_args(PARSER.parse_args(specs["router"]))
    assert (router.revision, router.served_model_names, router.chat_template) == (None, (), None)


def test_a_template_given_as_text_is_passed_as_text(monkeypatch):
    specs = _planned(monkeypatch, "--chat-template", TEMPLATE)
    assert config_from_args(PARSER.parse_args(specs["router"])).chat_template == TEMPLATE


def test_worker_args_still_have_the_last_word(monkeypatch):
    specs = _planned(monkeypatch, "--gpu-memory-utilization", "0.5", "--worker-args=--gpu-memory-utilization 0.7")
    assert PARSER.parse_args(specs["decode-0"]).gpu_memory_utilization == 0.7


@pytest.mark.parametrize("value", ["0", "1.5", "-1", "nan", "most"])
def test_a_bad_utilization_stops_up_before_anything_starts(monkeypatch, capsys, value):
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: pytest.fail("started"))
    with pytest.raises(SystemExit) as e:
        pdserve.cli.main.main(["up", "--gpu-memory-utilization", value])
    assert e.value.code == 2 and "gpu_memory_utilization: must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_workers_refuse_a_bad_utilization(capsys, role):
    with pytest.raises(SystemExit):
        PARSER.parse_args([role, "--gpu-memory-utilization", "0"])
    assert "gpu_memory_utilization: must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("template,problem", [
    ("missing.jinja", "chat_template: cannot read the file 'missing.jinja'"),
    ("{% for m in messages %}", "chat_template: not a Jinja template"),
])
def test_a_bad_template_stops_up_before_anything_starts(monkeypatch, capsys, tmp_path, template, problem):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: pytest.fail("started"))
    assert pdserve.cli.main.main(["up", "--chat-template", template]) == 2
    assert problem in capsys.readouterr().err


def test_generate_chat_uses_the_template(tiny_llama_dir, tmp_path, template_file, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert pdserve.cli.main.main(["generate", "--model", tiny_llama_dir, "--chat", "--chat-template", template_file,
                          "--prompt", "hi", "--max-tokens", "2", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompt"] == "<<T>>hi:"


def test_generate_refuses_a_bad_template(tiny_llama_dir, capsys):
    assert pdserve.cli.main.main(["generate", "--model", tiny_llama_dir, "--chat", "--chat-template",
                          os.devnull + "-missing", "--prompt", "hi"]) == 2
    assert "chat_template: cannot read the file" in capsys.readouterr().err
