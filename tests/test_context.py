"""The context builder with the real tokenizer: cache-friendly order, exact tokens, overflow."""

from __future__ import annotations

import pytest

from fairway.conversation.context_builder import ContextBuilder, ContextTooLong, split_turns

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 4}


def conversation(turns: int, words: int = 5) -> list[dict[str, str]]:
    out = []
    for i in range(turns):
        out.append({"role": "user", "content": f"question {i} " + "word " * words})
        out.append({"role": "assistant", "content": f"answer {i} " + "reply " * words})
    return out


def test_prompt_equals_the_whole_template_tokenized(real_tokenizer):
    builder = ContextBuilder(real_tokenizer, window=4096)
    history = conversation(3)
    new = [{"role": "user", "content": "And now?"}]
    context = builder.build([SYSTEM], history, new, max_tokens=64)
    assert context.prompt_token_ids == real_tokenizer.chat_prompt_ids([SYSTEM, *history, *new])
    assert context.dropped_turns == 0
    assert sum(context.segment_lengths) == context.num_tokens


class CountingTokenizer:
    """The real tokenizer, counting the messages the chat template renders."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.rendered = 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        self.rendered += len(messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def test_a_long_conversation_costs_each_turn_only_its_new_messages(real_tokenizer):
    """Turn after turn the history is re-sent whole; rendering it message by message from the
    start every time grew with the square of its length. Only the new messages are rendered now
    (and the whole once, for the generation prompt), and the tokens are exactly the same."""
    counting = CountingTokenizer(real_tokenizer)
    builder = ContextBuilder(counting, window=32768)
    history: list[dict[str, str]] = []
    for i in range(60):
        new = [{"role": "user", "content": f"Turn {i}: tell me more."}]
        counting.rendered = 0
        context = builder.build([SYSTEM], history, new, max_tokens=64)
        messages = 1 + len(history) + 1
        assert counting.rendered <= 4 * messages  # not ~messages**2 / 2
        if i % 20 == 19:
            assert context.prompt_token_ids == real_tokenizer.chat_prompt_ids([SYSTEM, *history, *new])
            assert context.prompt_token_ids == ContextBuilder(real_tokenizer, 32768).build(
                [SYSTEM], history, new, max_tokens=64).prompt_token_ids
        history += [*new, {"role": "assistant", "content": f"Part {i} of the answer."}]


MEMORIES = [{"role": "system", "content": "What you remember about the user:\n- User is allergic to peanuts."}]


def test_next_turn_starts_with_this_turns_prompt_and_reply(real_tokenizer):
    """The property the prefix cache needs: turn N+1's prompt = turn N's prompt + its reply + more,
    with the conversation's memory block after the stable system text and before the history."""
    builder = ContextBuilder(real_tokenizer, window=4096)
    history: list[dict[str, str]] = []
    previous: list[int] | None = None
    for i in range(5):
        new = [{"role": "user", "content": f"Turn {i}: tell me more."}]
        context = builder.build([SYSTEM], history, new, max_tokens=64, memories=MEMORIES)
        assert context.messages == [SYSTEM, *MEMORIES, *history, *new]
        assert context.prompt_token_ids == real_tokenizer.chat_prompt_ids(context.messages)
        if previous is not None:
            assert context.prompt_token_ids[: len(previous)] == previous
        reply = f"Here is more, part {i}."
        # What the replica had in its KV cache after answering: prompt + reply tokens (+ end of turn).
        previous = context.prompt_token_ids + real_tokenizer.encode(reply + "<|im_end|>")
        history += [*new, {"role": "assistant", "content": reply}]


def test_overflow_drops_whole_oldest_turns_never_the_system_text(real_tokenizer):
    history = conversation(6, words=40)
    new = [{"role": "user", "content": "the newest question"}]
    full = ContextBuilder(real_tokenizer, window=100_000).build([SYSTEM], history, new, max_tokens=16)
    window = full.num_tokens  # fits only with max_tokens 0: something must go at max_tokens 100
    context = ContextBuilder(real_tokenizer, window=window).build([SYSTEM], history, new, max_tokens=100)
    assert 1 <= context.dropped_turns < 6
    assert context.dropped_messages == 2 * context.dropped_turns
    assert context.num_tokens <= window - 100
    assert context.messages[0] == SYSTEM
    assert context.messages[-1] == new[0]
    kept = context.messages[1:-1]
    assert kept == history[2 * context.dropped_turns :]  # the newest turns, whole and in order
    # Dropping one turn fewer would not have fitted: it drops no more than it must.
    fewer = [SYSTEM, *history[2 * (context.dropped_turns - 1) :], *new]
    assert len(real_tokenizer.chat_prompt_ids(fewer)) > window - 100


def test_too_long_even_alone_is_an_error(real_tokenizer):
    builder = ContextBuilder(real_tokenizer, window=256)
    with pytest.raises(ContextTooLong) as err:
        builder.build([SYSTEM], conversation(2), [{"role": "user", "content": "long " * 400}], max_tokens=16)
    assert err.value.window == 256 and err.value.budget == 240 and err.value.num_tokens > 240


def test_split_turns():
    history = [
        {"role": "assistant", "content": "hello, how can I help?"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "system", "content": "later system note"},
        {"role": "assistant", "content": "d"},
    ]
    assert [len(t) for t in split_turns(history)] == [1, 2, 3]
