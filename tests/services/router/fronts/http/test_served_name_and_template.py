"""--served-model-name and --chat-template through a router in front of the shared cluster's
workers: the names /v1/models lists and a request may use (any other is today's 404), the
name every response reports, and the chat prompt the router tokenizes being the template's."""
from __future__ import annotations

import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.pb import router_pb2
from pdserve.services.router.fronts.http.schemas import ChatCompletionRequest
from pdserve.services.router.fronts.http.translate import chat_prompt
from tests.services.router.fronts.http.support import raw_request, start_router, sync_client

NAMES = ("tiny-chat", "tiny-alias")
TEMPLATE = ("<<PDSERVE-TEMPLATE>>{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}|{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "user", "content": "Name a river."}]
RENDERED = "<<PDSERVE-TEMPLATE>>[user] Name a river.|[assistant] "


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def named_router(shared_cluster, tiny, tiny_llama_dir, template_file):
    router = start_router(shared_cluster, tiny_llama_dir, tiny.tokenizer, served_model_names=NAMES,
                          chat_template=template_file)
    yield router
    router.stop(grace_s=1.0)


@pytest.fixture
def client(cluster, named_router):
    with sync_client(named_router) as c:
        yield c


def test_models_lists_the_served_names_first_first(client):
    assert [m.id for m in client.models.list().data] == list(NAMES)
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"


def test_every_served_name_is_accepted_and_the_first_is_reported(client):
    for name in NAMES:
        out = client.completions.create(model=name, prompt="Hello", max_tokens=2, temperature=0)
        assert out.model == "tiny-chat"
    chat = client.chat.completions.create(model="tiny-alias", messages=MESSAGES, max_tokens=2, temperature=0)
    assert chat.model == "tiny-chat"


def test_the_model_argument_is_no_longer_a_name_clients_use(client, tiny_llama_dir):
    for create in (lambda m: client.completions.create(model=m, prompt="Hi", max_tokens=1),
                   lambda m: client.chat.completions.create(model=m, messages=MESSAGES, max_tokens=1),
                   client.models.retrieve):
        with pytest.raises(openai.NotFoundError) as e:  # today's answer for an unknown model
            create(tiny_llama_dir)
        assert e.value.code == "model_not_found" and e.value.param == "model"
        assert "The model '" in e.value.message  # (a long name is shortened)
        assert "does not exist; this server serves 'tiny-chat'" in e.value.message


def test_grpc_list_models_reports_the_first_name(named_router):
    listed = named_router.servicer.ListModels(router_pb2.ListModelsRequest(), None)
    assert [m.id for m in listed.models] == ["tiny-chat"]


def test_the_router_tokenizes_the_template_s_rendering(named_router, tiny):
    tokenizer = named_router.servicer.front.validator.tokenizer
    body = ChatCompletionRequest(model="tiny-chat", messages=MESSAGES)
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == RENDERED
    assert chat_prompt(body, tokenizer, 8) == tiny.tokenizer.encode(RENDERED, add_special_tokens=False)
    assert tiny.tokenizer.chat_template != TEMPLATE  # the shared tokenizer keeps its own


def test_a_chat_answers_as_the_offline_engine_with_the_same_template(client, tiny, tiny_llama_dir, template_file):
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False, chat_template=template_file,
              kv_cache_memory_bytes=4 << 20)
    assert llm.apply_chat_template(MESSAGES) == RENDERED
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    offline = llm.chat(MESSAGES, params)[0]
    assert offline.prompt_token_ids == tiny.tokenizer.encode(RENDERED, add_special_tokens=False)
    chat = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert chat.choices[0].message.content == offline.text


def test_without_served_names_the_model_and_its_id_are_accepted(cluster, model):
    status, _, body = raw_request(cluster.router, "GET", "/v1/models")
    assert status == 200 and f'"id":"{model}"'.encode() in body.replace(b" ", b"")


@pytest.mark.parametrize("template,problem", [
    ("/no/such/template.jinja", "cannot read the file '/no/such/template.jinja'"),
    ("{% for m in messages %}{{ m }}", "not a Jinja template"),
])
def test_a_bad_template_fails_the_start_naming_chat_template(shared_cluster, tiny, tiny_llama_dir, template,
                                                             problem):
    with pytest.raises(ValueError, match="^chat_template: " + problem):
        start_router(shared_cluster, tiny_llama_dir, tiny.tokenizer, chat_template=template)


def test_a_broken_template_file_fails_the_start(shared_cluster, tiny, tiny_llama_dir, tmp_path):
    path = tmp_path / "broken.jinja"
    path.write_text("{% if add_generation_prompt %}")
    with pytest.raises(ValueError, match="^chat_template: not a Jinja template"):
        start_router(shared_cluster, tiny_llama_dir, tiny.tokenizer, chat_template=str(path))
