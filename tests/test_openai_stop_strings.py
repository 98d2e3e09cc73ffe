"""Stop strings and ``min_tokens`` in the OpenAI frontend (serving.openai.choice.ChoiceReader) against
an oracle that reads one token at a time: after each token past ``min_tokens``, the text ends before
the earliest-beginning match that ends in that token's characters, and the tokens counted are those
through it. The responses are made as the server makes them (``stream_window`` / ``stream_text``),
grouped as speculative steps would group them: the answer must not depend on the grouping."""
import random

import pytest
from tokenizers import Tokenizer

from builder import embedded
from serving.openai.choice import ChoiceReader
from serving.openai.protocol import Generation
from serving.protocol import byte_fallback_ids, stream_text, stream_window, text_history

TOKENIZER = Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))
BYTE_IDS = byte_fallback_ids(TOKENIZER)
PROMPT = TOKENIZER.encode("x = 1\n", add_special_tokens=False).ids


class Response:
    """What serving.openai.backend.Delta carries of a response."""
    def __init__(self, text, ids, finish_reason):
        self.text, self.ids, self.tokens, self.finish_reason, self.stats = text, list(ids), len(ids), finish_reason, {}


def _pieces(prompt, ids, cuts):
    """(new text, new ids, last) per group of ``ids`` ending at each cut, as the server streams them."""
    out, emitted, start = [], [], 0
    for end in [c for c in cuts if 0 < c < len(ids)] + [len(ids)]:
        new = ids[start:end]
        context, prefix = stream_window(text_history(prompt, emitted), new, BYTE_IDS)
        out.append((stream_text(TOKENIZER, context, prefix, end == len(ids)), new, end == len(ids)))
        emitted, start = emitted + new, end
    return out


def frontend(prompt, ids, cuts, stops, min_tokens):
    """(text, completion tokens, finish reason) as the frontend answers the grouped responses."""
    reader = ChoiceReader(TOKENIZER, Generation(prompt="", max_tokens=len(ids), stop=stops, min_tokens=min_tokens),
                          prompt, False)
    text = ""
    for piece, new, last in _pieces(prompt, ids, cuts):
        text += reader.read(Response(piece, new, "length" if last else ""))[0]
        if reader.reason:
            break
    return text + reader.flush(), reader.tokens, reader.reason


def one_token_at_a_time(prompt, ids, stops, min_tokens):
    """The oracle: each token's text as the server would stream it alone, stops checked after it."""
    text = ""
    for n, (piece, _, _) in enumerate(_pieces(prompt, ids, range(1, len(ids))), 1):
        text += piece
        if n > min_tokens:
            starts = [i for s in stops if (i := text.find(s, max(0, len(text) - len(piece) - len(s) + 1))) >= 0]
            if starts:
                return text[:min(starts)], n, "stop"
    return text, len(ids), "length"


def _token(text):
    (t,) = TOKENIZER.encode(text, add_special_tokens=False).ids
    return t


GROUPINGS = {"one step": [], "one by one": None, "2+rest": [2]}


@pytest.mark.parametrize("cuts", list(GROUPINGS.values()), ids=list(GROUPINGS))
def test_a_stop_inside_the_start_of_a_longer_one_generated_within_min_tokens_ends_nothing(cuts):
    """'self' '\\n' 'turn', min_tokens 2, stops '\\n' and '\\n\\n': the only newline is the 2nd token.
    The frontend held it back unarmed (it begins '\\n\\n') and, once the stops armed, matched it:
    'self' with 'stop' where the answer is the whole text."""
    ids = [_token("self"), _token("\n"), _token("turn")]
    cuts = range(1, len(ids)) if cuts is None else cuts
    assert frontend(PROMPT, ids, cuts, ["\n", "\n\n"], 2) == ("self\nturn", 3, "length")


@pytest.mark.parametrize("cuts", list(GROUPINGS.values()), ids=list(GROUPINGS))
def test_the_stop_past_min_tokens_ends_the_text_not_the_one_within(cuts):
    """'\\n' 'self' '\\n', min_tokens 1: the second newline stops ('\\nself', 3 tokens). The frontend
    cut at the first: '' counted as 2 or 3 tokens by the grouping."""
    ids = [_token("\n"), _token("self"), _token("\n")]
    cuts = range(1, len(ids)) if cuts is None else cuts
    assert frontend(PROMPT, ids, cuts, ["\n", "\n\n"], 1) == ("\nself", 3, "stop")


def test_the_stop_completing_first_ends_the_text_whatever_the_grouping():
    """Stops '\\nHuman:' and 'Human' on 'ok\\nHuman: hi': one token at a time 'Human' completes first
    ('ok\\n'); in one speculative step the frontend took '\\nHuman:', which begins earlier ('ok')."""
    ids = TOKENIZER.encode("ok\nHuman: hi", add_special_tokens=False).ids
    stops = ["\nHuman:", "Human"]
    want = one_token_at_a_time(PROMPT, ids, stops, 0)
    assert want[0] == "ok\n"
    assert frontend(PROMPT, ids, [], stops, 0) == frontend(PROMPT, ids, range(1, len(ids)), stops, 0) == want


def test_random_stops_and_groupings_answer_as_one_token_at_a_time():
    """Random ids (byte runs and split characters among them), stops cut from the generated text (one
    or two, overlapping ones too), min_tokens 0-5, a random grouping and one token per response."""
    rng = random.Random(0)
    prompts = [TOKENIZER.encode(p, add_special_tokens=False).ids for p in ("def f(x):", "import os\n", "# é\n", "x = [")]
    vocab, checked = TOKENIZER.get_vocab_size(), 0
    for _ in range(1500):
        prompt, n = rng.choice(prompts), rng.randint(1, 14)
        ids = [rng.randrange(vocab) for _ in range(n)]
        text = one_token_at_a_time(prompt, ids, [], 0)[0]
        if not text:
            continue
        stops = []
        for _ in range(rng.randint(1, 2)):
            at = rng.randrange(len(text))
            stops.append(text[at:at + rng.randint(1, 4)])
        stops = [s for s in stops if "\ufffd" not in s] or ["zzz"]
        min_tokens = rng.choice([0, 0, 1, 2, 3, 5])
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
        want = one_token_at_a_time(prompt, ids, stops, min_tokens)
        case = dict(prompt=prompt, ids=ids, cuts=cuts, stops=stops, min_tokens=min_tokens)
        assert frontend(prompt, ids, cuts, stops, min_tokens) == want, case
        assert frontend(prompt, ids, range(1, n), stops, min_tokens) == want, case
        checked += want[2] == "stop"
    assert checked > 500     # most cases stop: the oracle's stops are cut from its own text
