"""The OpenAI frontend's chat template rendering against transformers' ``apply_chat_template``: the
same prompt for templates that use what transformers' environment has beyond plain jinja2 (loop
controls, ``{% generation %}``, ``strftime_now``, ``tojson``'s keywords). Without them a template with
``{% break %}`` kept the frontend from starting, ``tojson(sort_keys=true)`` failed every chat request,
and a template asking ``strftime_now is defined`` rendered its fallback date."""
import pytest
from tokenizers import Tokenizer

from builder import embedded
from serving.openai.chat_template import ChatTemplate

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "caf\u00e9?"},
            {"role": "assistant", "content": "never rendered"}]
TEMPLATES = {
    "loop controls": "{% for m in messages %}{% if loop.index > 4 %}{% break %}{% endif %}"
                     "{% if m.role == 'system' %}{% continue %}{% endif %}<{{ m.role }}>{{ m.content }}\n{% endfor %}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
                  "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}",
    "strftime_now": "{% if strftime_now is defined %}{{ strftime_now('%Y-%m') }}{% else %}no clock{% endif %}"
                    "{{ messages[-1].content }}",
    "tojson": "{{ messages[1] | tojson(sort_keys=true, indent=2, separators=(',', ': ')) }}"
              "{{ messages[3] | tojson }}{{ messages[3] | tojson(ensure_ascii=true) }}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_template_renders_the_prompt_transformers_renders(name):
    from transformers import PreTrainedTokenizerFast
    source = TEMPLATES[name] + "{% if add_generation_prompt %}<assistant>{% endif %}"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json")))
    want = tokenizer.apply_chat_template(MESSAGES, chat_template=source, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate(source).render(MESSAGES) == want
    assert "no clock" not in want


def test_a_build_reads_every_such_template(tmp_path):
    """The build checks the checkpoint's template parses (a damaged one is one line at build, not a
    failing chat endpoint later) in the same environment: it refused {% break %} and {% generation %}."""
    import json

    from builder.tokenizer_file import read_tokenizer_config
    for name, source in TEMPLATES.items():
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
        assert read_tokenizer_config(tmp_path / "tokenizer_config.json")["chat_template"] == source, name


def test_the_served_end_ids_take_the_tokenizers_eos_token(tmp_path):
    """The speculative model stops on tokenizer_config.json's eos_token beside the model's end ids, as
    vLLM and the TensorRT-LLM backend do (a chat template ends each turn with it)."""
    import json

    from builder.tokenizer_file import tokenizer_eos_id
    tokenizer = Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))
    assert tokenizer_eos_id(tmp_path, tokenizer) is None                       # no tokenizer_config.json
    for eos, want in (("</s>", tokenizer.token_to_id("</s>")), ({"content": "<s>"}, tokenizer.token_to_id("<s>")),
                      ("<not a token>", None), (None, None)):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
        assert tokenizer_eos_id(tmp_path, tokenizer) == want, eos
    assert tokenizer.token_to_id("</s>") is not None
