"""bench/spec_acceptance.py's workload builder and option parsing (no model)."""
from __future__ import annotations

from bench.spec_acceptance import FREE_PROMPTS, INSTRUCTIONS, PASSAGES, build_workload, parse_lookups


def test_passages_are_100_to_200_words_and_distinct():
    assert len(PASSAGES) == 6
    assert len({name for name, _ in PASSAGES}) == len(PASSAGES)
    for name, text in PASSAGES:
        assert 100 <= len(text.split()) <= 200, name


def test_workload_puts_each_passage_in_its_prompt_and_cycles_instructions():
    items = build_workload(copy_output_len=96, free_output_len=64)
    copy = [it for it in items if it["workload"] == "copy"]
    free = [it for it in items if it["workload"] == "free"]
    assert len(copy) == len(PASSAGES) and len(free) == len(FREE_PROMPTS)
    assert [it["kind"] for it in copy] == [INSTRUCTIONS[i % 3][0] for i in range(len(PASSAGES))]
    for it, (_, passage) in zip(copy, PASSAGES):
        assert passage in it["prompt"] and it["max_tokens"] == 96
    assert all(it["max_tokens"] == 64 and it["kind"] == "free" for it in free)


def test_workload_applies_a_chat_template_when_the_tokenizer_has_one():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "<user>" + messages[0]["content"] + "<model>"

    items = build_workload(Tok())
    assert all(it["prompt"].startswith("<user>") and it["prompt"].endswith("<model>") for it in items)
    plain = build_workload(object())
    assert not plain[0]["prompt"].startswith("<user>")


def test_parse_lookups():
    assert parse_lookups(None) == ((1, 3), (2, 4))
    assert parse_lookups("1-3,2-4") == ((1, 3), (2, 4))
    assert parse_lookups("2") == ((2, 2),)
    assert parse_lookups([(1, 2)]) == ((1, 2),)
