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
