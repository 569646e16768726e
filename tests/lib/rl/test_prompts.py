"""The GRPO prompt stream: seeded epoch order, exact continuation from a saved state, prepared
rows read back with their extra columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config.recipes import OutputConfig, PrepareConfig, load_recipe
from posttrain.errors import DataError
from posttrain.rl.prompts import PromptRow, PromptStream, read_prompt_rows

ROOT = Path(__file__).resolve().parents[3]


def rows(n: int) -> list[PromptRow]:
    return [PromptRow([i], [{"role": "user", "content": str(i)}], {"answer": i})
            for i in range(n)]


def test_every_row_once_per_epoch_in_a_seeded_order():
    stream = PromptStream(rows(7), seed=3)
    epoch0 = [r.prompt_ids[0] for r in stream.next_batch(7)]
    epoch1 = [r.prompt_ids[0] for r in stream.next_batch(7)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(7))
    assert epoch0 != epoch1 and epoch0 != list(range(7))
    again = PromptStream(rows(7), seed=3)
    assert [r.prompt_ids[0] for r in again.next_batch(14)] == epoch0 + epoch1
    other = PromptStream(rows(7), seed=4)
    assert [r.prompt_ids[0] for r in other.next_batch(7)] != epoch0


@pytest.mark.parametrize("taken", [0, 3, 7, 10])
def test_restored_state_continues_identically(taken):
    a = PromptStream(rows(7), seed=1)
    a.next_batch(taken)
    state = a.state_dict()
    b = PromptStream(rows(7), seed=1)
    b.load_state_dict(state)
    assert [r.prompt_ids for r in a.next_batch(12)] == [r.prompt_ids for r in b.next_batch(12)]


def test_state_for_other_data_is_refused():
    state = PromptStream(rows(7)).state_dict()
    with pytest.raises(DataError, match="7 rows but the prepared data has 5"):
        PromptStream(rows(5)).load_state_dict(state)


def test_read_prepared_arithmetic_prompts(tmp_path):
    from steps import prepare
    cfg = load_recipe(ROOT / "configs/prepare/sample_arithmetic_prompts.yaml", PrepareConfig)
    cfg = PrepareConfig(tokenizer=cfg.tokenizer, data=cfg.data,
                        output=OutputConfig(dir=str(tmp_path / "prepared")))
    prepare.run(cfg, show_progress=False)
    train = read_prompt_rows(str(tmp_path / "prepared"), "train")
    assert len(train) == 2000
    first = train[0]
    assert first.messages == [{"role": "user", "content": "What is 90 + 62?"}]
    assert first.extras == {"answer": "152"}
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "prepared" / "tokenizer"))
    assert tok.decode(first.prompt_ids).endswith("What is 90 + 62?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(DataError, match="GRPO needs data prepared with format: prompt"):
        sft = load_recipe(ROOT / "configs/prepare/sample_chat.yaml", PrepareConfig)
        prepare.run(PrepareConfig(tokenizer=sft.tokenizer, data=sft.data,
                                  output=OutputConfig(dir=str(tmp_path / "chat"))),
                    show_progress=False)
        read_prompt_rows(str(tmp_path / "chat"), "train")
