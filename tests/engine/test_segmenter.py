"""The segmenter: speakable units from a token stream, losing nothing."""

from hypothesis import given, settings, strategies as st

from voxgate.engine.text.segmenter import Segmenter, SegmenterConfig, speakable


def segment(text: str, step: int = 1) -> list:
    seg = Segmenter()
    units = []
    for i in range(0, len(text), step):
        units += seg.push(text[i : i + step])
    units += seg.end()
    return units


def spoken(text: str, step: int = 1) -> list[str]:
    return [u.speak.strip() for u in segment(text, step) if u.speak]


def test_first_unit_is_the_first_clause_then_whole_sentences():
    units = spoken("Sure thing, I can help with that. The weather today is sunny, with a light breeze from the west.")
    assert units[0] == "Sure thing,"
    assert units[1] == "I can help with that."
    # Later commas do not split a sentence of ordinary length.
    assert units[2] == "The weather today is sunny, with a light breeze from the west."


def test_abbreviations_decimals_and_times_do_not_end_a_sentence():
    units = spoken("Hi! Dr. Smith paid $3.14 at 10:30 on Jan. 5, e.g. for coffee, and left. Then nothing.")
    assert units == ["Hi!", "Dr. Smith paid $3.14 at 10:30 on Jan. 5, e.g. for coffee, and left.", "Then nothing."]


def test_a_price_at_the_end_of_a_sentence_is_a_boundary():
    assert spoken("Hello there. It costs $29. Next we talk about shipping options.") == [
        "Hello there.", "It costs $29. Next we talk about shipping options."
    ]
    assert spoken("Okay. The total price comes to $29. Next we talk about shipping.") == [
        "Okay.", "The total price comes to $29.", "Next we talk about shipping."
    ]


def test_urls_and_emails_are_said_not_spelled():
    units = spoken("Visit https://example.com/docs?x=1 today. Or mail help@voxgate.dev now.")
    assert units[0] == "Visit example dot com today."
    assert "help at voxgate dot dev" in units[1]


def test_markdown_lists_and_emoji_are_not_spoken():
    units = spoken("Here you go:\n- **Apples** 🍎\n- _Pears_\n1. First `step`\n## Heading\n")
    joined = " ".join(units)
    for mark in ("*", "_", "`", "#", "🍎", "- "):
        assert mark not in joined
    assert "Apples" in units[1] and "Pears" in units[2]
    assert units[3] == "1. First step"


def test_whitespace_and_punctuation_only_input_produce_nothing_to_say():
    for text in ["   ", "\n\n", "...", "!?!", "— –", "🎉🎉"]:
        units = segment(text)
        assert "".join(u.raw for u in units) == text
        assert all(u.speak == "" for u in units)


def test_long_text_without_punctuation_is_split_at_a_bounded_length():
    cfg = SegmenterConfig()
    text = " ".join(f"word{i}" for i in range(400))
    units = segment(text, 7)
    assert len(units) > 5
    assert all(len(u.raw) <= cfg.max_chars + 1 for u in units)
    assert all(not u.raw.strip().startswith("ord") for u in units)  # split between words


def test_timeout_flush_gives_the_first_whole_words():
    seg = Segmenter()
    assert seg.push("So what I was thinking is that we") == []
    units = seg.flush_first()
    assert [u.speak for u in units] == ["So what I was thinking is that "]
    assert seg.pending == "we"
    assert seg.flush_first() == []  # only the first unit is ever forced


def test_an_unfinished_tag_is_never_cut():
    seg = Segmenter()
    units = seg.push("Hello there, <break time=")
    assert [u.speak for u in units] == ["Hello there, "]
    assert seg.push('"500ms"/> world. Next') and seg.pending == "Next"


tokens = st.lists(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
    | st.sampled_from([". ", "Dr.", " e.g. ", "3.14", "10:30", ",", "\n", "- ", "**", "<b", ">", "🎉", "  ", "http://a.b/c "]),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(tokens)
def test_property_text_is_never_lost_duplicated_or_reordered(pieces):
    text = "".join(pieces)
    seg = Segmenter()
    units = []
    for piece in pieces:
        units += seg.push(piece)
        if len(units) == 0 and piece.endswith(" "):
            units += seg.flush_first()
    units += seg.end()
    assert "".join(u.raw for u in units) == text
    assert sum(1 for u in units if u.first) <= 1
    for u in units:
        assert u.speak == speakable(u.raw)
