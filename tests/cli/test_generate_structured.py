"""`pdserve generate`'s structured-output flags: parsed into the engine's spec, refused with
an error naming the flag or field, and sent on: to the offline engine and through a router."""
from __future__ import annotations

import json
import re

import pytest

from pdserve.cli.main import build_parser, main
from pdserve.cli.structured_args import structured_from_args
from pdserve.engine.structured import StructuredOutputsParams
from tests.services.router.fakes import start_fake_cluster

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _spec(*flags: str) -> StructuredOutputsParams | None:
    return structured_from_args(build_parser().parse_args(["generate", "--prompt", "Hi", *flags]))


def test_each_flag_becomes_its_spec(tmp_path):
    schema_file, grammar_file = tmp_path / "s.json", tmp_path / "g.ebnf"
    schema_file.write_text(json.dumps(SCHEMA))
    grammar_file.write_text('root ::= "yes" | "no"')
    assert _spec() is None
    assert _spec("--json-schema", str(schema_file)) == StructuredOutputsParams(json=SCHEMA)
    assert _spec("--regex", "[0-9]+") == StructuredOutputsParams(regex="[0-9]+")
    assert _spec("--choice", "yes", "--choice", "no") == StructuredOutputsParams(choice=["yes", "no"])
    assert _spec("--grammar", str(grammar_file)) == StructuredOutputsParams(grammar='root ::= "yes" | "no"')
    assert _spec("--json-object") == StructuredOutputsParams(json_object=True)


@pytest.mark.parametrize("flags", [("--regex", "a", "--choice", "a"), ("--json-object", "--regex", "a"),
                                   ("--json-schema", "s.json", "--grammar", "g.ebnf")])
def test_two_specs_are_refused_by_the_parser(capsys, flags):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "--prompt", "Hi", *flags])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("flags,says", [
    (("--json-schema", "{missing}"), "--json-schema: cannot read"),
    (("--grammar", "{missing}"), "--grammar: cannot read"),
    (("--json-schema", "{not_json}"), "--json-schema: "),
    (("--choice", ""), "structured_outputs.choice:"),
    (("--regex", ""), "structured_outputs.regex:"),
])
def test_a_bad_spec_is_an_error_naming_it(tmp_path, capsys, flags, says):
    (tmp_path / "bad.json").write_text("{not json")
    paths = {"{missing}": str(tmp_path / "missing"), "{not_json}": str(tmp_path / "bad.json")}
    argv = ["generate", "--prompt", "Hi", "--url", "127.0.0.1:1", *(paths.get(f, f) for f in flags)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve: error: {says}")
    if "not_json" in flags[1]:
        assert "is not JSON" in err


def test_the_spec_travels_through_the_router(tiny_llama_dir, capsys):
    from pdserve.engine import load_tokenizer
    cluster = start_fake_cluster(tiny_llama_dir, load_tokenizer(tiny_llama_dir), num_prefill=1, num_decode=1)
    try:
        assert main(["generate", "--prompt", "Hi", "--url", cluster.router.address, "--max-tokens", "2",
                     "--choice", "yes", "--choice", "no", "--json"]) == 0
        request, = cluster.decodes[0].requests
        assert list(request.sampling.structured_outputs.choice.choices) == ["yes", "no"]
        assert json.loads(capsys.readouterr().out)["finish_reason"] == "length"
        # and a spec the router cannot compile is its INVALID_ARGUMENT, naming the field
        assert main(["generate", "--prompt", "Hi", "--url", cluster.router.address, "--regex", "a(b"]) == 2
        assert "INVALID_ARGUMENT: structured_outputs.regex: does not compile" in capsys.readouterr().err
        assert len(cluster.decodes[0].requests) == 1
    finally:
        cluster.stop()


def test_offline_generation_follows_the_regex(tiny_llama_dir, capsys):
    pattern = "[0-9]{2}-[a-c]{2}"
    assert main(["generate", "--model", tiny_llama_dir, "--prompt", "Code:", "--max-tokens", "32",
                 "--regex", pattern, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert re.fullmatch(pattern, out["text"]) and out["finish_reason"] == "stop", out
