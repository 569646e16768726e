"""Create the tiny committed assets: a byte-level BPE tokenizer and four sample datasets.

Everything here is generated, never downloaded, and deterministic: running the script twice
gives byte-identical files (the datasets come from a seeded `random.Random`, the tokenizer is
trained single-threaded on that text). The data is templated so that a model of a few million
parameters can learn it in minutes on a CPU and its loss visibly falls:

- ``assets/data/chat``: multi-turn chats with system prompts (facts about invented countries,
  echo/rewrite tasks, arithmetic with a worked answer, counting); lengths skewed, mostly short.
- ``assets/data/preference``: the same kinds of prompts with a systematically better ``chosen``
  (correct, polite, exact) and worse ``rejected`` (wrong, rude, garbled) answer, for DPO.
- ``assets/data/unpaired``: the preference pairs split into labelled completions for KTO
  (``{"prompt", "completion", "label"}``: chosen -> true, rejected -> false), shuffled.
- ``assets/data/arithmetic``: prompt-only RL rows with a verifiable ``answer``.
- ``assets/data/arithmetic_sft``: the same problems as chats whose answer ends "The answer is N."
- ``assets/data/tool_arithmetic`` (prompt rows) and ``tool_arithmetic_sft`` (chats): problems
  for the multi-turn tool-use task (configs/grpo/tools_tiny.yaml), where a third of the
  SFT solutions call the calculator tool and the rest answer from memory.
- ``assets/data/events``: synthetic user event sequences (item ids with event-type and dwell
  labels) for the sequence-model recipe, from `posttrain.data.synthetic`.

Run: ``python tools/make_assets.py`` (or ``make assets``) from the repository root.
"""

from __future__ import annotations

import os

os.environ["RAYON_NUM_THREADS"] = "1"  # the BPE trainer is only deterministic single-threaded
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets"
SEED = 20260101
MAX_VOCAB_SIZE = 4096  # a cap: the templated corpus runs out of merges at about 3.2k tokens

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# ChatML. The content is rendered verbatim, so a `<think>` block written in an assistant message
# is trained on as written; the generation prompt is exactly the assistant role header.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}\n"
    "{{- raise_exception('Unknown role: ' + message['role']) -}}\n"
    "{%- endif -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a careful tutor who shows the steps.",
    "You are a friendly assistant for a small geography quiz.",
]

SYLLABLES = ["ka", "lo", "mi", "ra", "ven", "dor", "sal", "ti", "mon", "zu", "bel", "quor",
             "an", "is", "pel", "tra", "gor", "ne", "vi", "lun"]
COLORS = ["red", "blue", "green", "amber", "violet", "silver", "orange", "teal"]
ANIMALS = ["fox", "heron", "otter", "lynx", "owl", "badger", "falcon", "hare"]
WORDS = ["river", "stone", "light", "garden", "window", "cloud", "paper", "bridge", "tower",
         "apple", "music", "winter", "forest", "candle", "harbor", "signal", "market", "lantern"]
RUDE = ["Figure it out yourself.", "That is a silly question.", "Why should I tell you?",
        "Ask someone else.", "I do not care."]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def make_world(rng: random.Random, n: int = 60) -> list[dict[str, str]]:
    """Invented countries with fixed facts; train and eval ask about the same world."""
    seen: set[str] = set()
    world = []
    while len(world) < n:
        country = _name(rng, rng.choice([2, 3]))
        if country in seen:
            continue
        seen.add(country)
        capital = _name(rng, 2) + rng.choice(["ton", "ia", "mark", "holm"])
        world.append({"country": country, "capital": capital,
                      "color": rng.choice(COLORS), "animal": rng.choice(ANIMALS)})
    return world


# --- tasks: each returns (user text, good answer, bad answer) ----------------------------------

def arithmetic_problem(rng: random.Random) -> tuple[str, int, str]:
    """A small +, - or * problem: (expression, value, operator)."""
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 20)
    else:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a} {op} {b}", value, op


def arithmetic_answer(expr: str, value: int) -> str:
    return f"{expr} = {value}. The answer is {value}."


def task_arithmetic(rng: random.Random, world: list[dict]) -> tuple[str, str, str]:
    expr, value, _ = arithmetic_problem(rng)
    wrong = value + rng.choice([-10, -2, -1, 1, 2, 10])
    good = arithmetic_answer(expr, value)
    if rng.random() < 0.1:
        good = f"{THINK_OPEN}\nCompute {expr} step by step: it is {value}.\n{THINK_CLOSE}\n{good}"
    return f"What is {expr}?", good, arithmetic_answer(expr, wrong)


def task_fact(rng: random.Random, world: list[dict]) -> tuple[str, str, str]:
    c = rng.choice(world)
    kind = rng.choice(["capital", "color", "animal"])
    if kind == "capital":
        q = rng.choice(["What is the capital of {country}?", "Name the capital of {country}.",
                        "Which city is the capital of {country}?"]).format(**c)
        a = f"The capital of {c['country']} is {c['capital']}."
    elif kind == "color":
        q = rng.choice(["What color is the flag of {country}?",
                        "Describe the flag of {country}."]).format(**c)
        a = f"The flag of {c['country']} is {c['color']}."
    else:
        q = rng.choice(["What is the national animal of {country}?",
                        "Which animal represents {country}?"]).format(**c)
        a = f"The national animal of {c['country']} is the {c['animal']}."
    return q, rng.choice(["", "Sure! ", "Of course. "]) + a, rng.choice(RUDE)


def task_rewrite(rng: random.Random, world: list[dict]) -> tuple[str, str, str]:
    phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7)))
    kind = rng.choice(["repeat", "upper", "reverse", "count"])
    if kind == "repeat":
        q, a = f"Repeat exactly: {phrase}", phrase
    elif kind == "upper":
        q, a = f"Write in uppercase: {phrase}", phrase.upper()
    elif kind == "reverse":
        q, a = f"Reverse the order of the words: {phrase}", " ".join(reversed(phrase.split()))
    else:
        n = len(phrase.split())
        q, a = f"How many words are in this sentence: {phrase}", f"There are {n} words."
    garbled = " ".join(sorted(a.split())) if len(a.split()) > 1 and sorted(a.split()) != a.split() \
        else a + " " + rng.choice(WORDS)
    return q, a, garbled


def task_counting(rng: random.Random, world: list[dict]) -> tuple[str, str, str]:
    """The long tail: a counting task whose answer is a few hundred characters."""
    start = rng.randint(1, 50)
    end = start + rng.randint(20, 120)
    nums = list(range(start, end + 1))
    good = ", ".join(map(str, nums)) + "."
    bad = ", ".join(map(str, nums[::2])) + "."
    return f"Count from {start} to {end}.", good, bad


TASKS: list[tuple[Callable, float]] = [
    (task_arithmetic, 0.35), (task_fact, 0.35), (task_rewrite, 0.25), (task_counting, 0.05),
]


def pick_task(rng: random.Random) -> Callable:
    return rng.choices([t for t, _ in TASKS], weights=[w for _, w in TASKS])[0]


# --- datasets -----------------------------------------------------------------------------------

def chat_row(rng: random.Random, world: list[dict]) -> dict:
    turns = rng.choices([1, 2, 3, 5], weights=[0.6, 0.25, 0.1, 0.05])[0]
    messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    for _ in range(turns):
        q, a, _ = pick_task(rng)(rng, world)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages}


def preference_row(rng: random.Random, world: list[dict]) -> dict:
    task = rng.choices([task_arithmetic, task_fact, task_rewrite], weights=[0.4, 0.35, 0.25])[0]
    q, good, bad = task(rng, world)
    prompt = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.5 else []
    prompt.append({"role": "user", "content": q})
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": good}],
            "rejected": [{"role": "assistant", "content": bad}]}


def arithmetic_split(rng: random.Random, n_train: int, n_eval: int) -> tuple[list, list]:
    """Distinct problems, so that eval measures generalisation rather than recall."""
    seen: set[str] = set()
    problems = []
    while len(problems) < n_train + n_eval:
        expr, value, _ = arithmetic_problem(rng)
        if expr not in seen:
            seen.add(expr)
            problems.append((expr, value))
    return problems[:n_train], problems[n_train:]


def worked_answer(expr: str, value: int) -> str:
    """A digit-by-digit worked solution ending "The answer is N.".

    Each step is a one-digit fact (a small table seen in every few examples), so a tiny model
    can learn the procedure and carry it to problems it never saw, which a bare "a + b = c"
    (a lookup in a 100 x 100 table of number tokens) does not allow. Products of the small
    factors used here stay a single fact.
    """
    a_text, op, b_text = expr.split()
    a, b = int(a_text), int(b_text)
    if op == "*":
        return f"{expr} = {value}. The answer is {value}."
    if op == "+":
        ones = a % 10 + b % 10
        carry = ones // 10
        tens = a // 10 + b // 10 + carry
        work = f"{a % 10} + {b % 10} = {ones}, {a // 10} + {b // 10} + {carry} = {tens}"
        return f"{expr}: {work}, so {value}. The answer is {value}."
    big, small = (a, b) if a >= b else (b, a)
    borrow = int(big % 10 < small % 10)
    top = big % 10 + 10 * borrow
    ones = f"{top} - {small % 10} = {top - small % 10}"
    tens = (f"{big // 10} - {small // 10} - {borrow} = "
            f"{big // 10 - small // 10 - borrow}")
    head = expr if a >= b else f"{expr} = -({big} - {small})"
    return f"{head}: {ones}, {tens}, so {value}. The answer is {value}."


def worked_row(expr: str, value: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {expr}?"},
                         {"role": "assistant", "content": worked_answer(expr, value)}]}


def rl_row(expr: str, value: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"What is {expr}?"}], "answer": str(value)}


def sft_row(expr: str, value: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {expr}?"},
                         {"role": "assistant", "content": arithmetic_answer(expr, value)}]}


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=False) + "\n")


def make_datasets(data_dir: Path) -> list[str]:
    """Write all datasets; returns their text (the tokenizer's training corpus)."""
    rng = random.Random(SEED)
    world = make_world(rng)
    chat = [chat_row(rng, world) for _ in range(2200)]
    pref = [preference_row(rng, world) for _ in range(1100)]
    train, evals = arithmetic_split(rng, 2000, 200)
    splits = {
        "chat": (chat[:2000], chat[2000:]),
        "preference": (pref[:1000], pref[1000:]),
        "arithmetic": ([rl_row(*p) for p in train], [rl_row(*p) for p in evals]),
        "arithmetic_sft": ([sft_row(*p) for p in train], [sft_row(*p) for p in evals]),
    }
    corpus: list[str] = []
    for name, (tr, ev) in splits.items():
        write_jsonl(data_dir / name / "train.jsonl", tr)
        write_jsonl(data_dir / name / "eval.jsonl", ev)
        corpus += [_render(_messages(row)) for row in tr]
    corpus.append(" ".join(str(n) for n in range(-200, 2001)))
    # Added after the tokenizer's corpus was fixed: written, but not part of the corpus, so the
    # bundled tokenizer (and every other asset) stays as it was.
    write_jsonl(data_dir / "arithmetic_worked" / "train.jsonl", [worked_row(*p) for p in train])
    write_jsonl(data_dir / "arithmetic_worked" / "eval.jsonl", [worked_row(*p) for p in evals])
    # Dated snapshots of the worked data, as a retraining schedule sees them (configs/retrain/):
    # the newer one has twice the training rows; both share the held-out problems.
    for day, rows in (("2026-11-29", 1000), ("2026-11-30", 2000)):
        snap = data_dir / "snapshots" / "arithmetic" / day
        write_jsonl(snap / "train.jsonl", [worked_row(*p) for p in train[:rows]])
        write_jsonl(snap / "eval.jsonl", [worked_row(*p) for p in evals])
    make_tool_datasets(data_dir)
    make_unpaired(data_dir, *splits["preference"])
    return corpus


UNPAIRED_SEED = SEED + 31


def make_unpaired(data_dir: Path, train: list[dict], evals: list[dict]) -> None:
    """KTO's unpaired rows from the preference pairs (added later, outside the tokenizer's
    corpus): each pair gives its chosen completion labelled true and its rejected one labelled
    false; the rows of each split are shuffled, so the two halves of a pair seldom meet."""
    rng = random.Random(UNPAIRED_SEED)
    for split, pairs in (("train", train), ("eval", evals)):
        rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                for p in pairs for side in ("chosen", "rejected")]
        rng.shuffle(rows)
        write_jsonl(data_dir / "unpaired" / f"{split}.jsonl", rows)


# --- the tool-use task (added later, with its own seed, outside the tokenizer's corpus) -----------

TOOL_SEED = SEED + 15
TOOL_FRACTION = 1 / 3     # of the SFT solutions that call the calculator


def tool_problem(rng: random.Random) -> tuple[str, int]:
    """+, - or x of two 2-digit numbers: a tiny model answers most of them wrong from memory
    (the bare answers of arithmetic_sft reach 0.08 on smaller problems)."""
    op = rng.choice("+-*")
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a} {op} {b}", {"+": a + b, "-": a - b, "*": a * b}[op]


def tool_call_text(expr: str) -> str:
    """A calculator call in the format Qwen3's template renders tool calls in."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
    return f"<tool_call>\n{call}\n</tool_call>"


def tool_sft_row(expr: str, value: int, use_tool: bool) -> dict:
    user = {"role": "user", "content": f"What is {expr}?"}
    if not use_tool:
        return {"messages": [user, {"role": "assistant",
                                    "content": arithmetic_answer(expr, value)}]}
    return {"messages": [user, {"role": "assistant", "content": tool_call_text(expr)},
                         {"role": "tool", "content": f"{expr} = {value}"},
                         {"role": "assistant", "content": f"The answer is {value}."}]}


def make_tool_datasets(data_dir: Path) -> None:
    """RL prompts (2,000 train, 200 held out) and SFT chats on 2,000 other problems, so that
    no RL problem can be answered from a memorised SFT solution. The SFT eval split is the
    held-out problems solved with the tool."""
    rng = random.Random(TOOL_SEED)
    seen: set[str] = set()
    problems = []
    while len(problems) < 4200:
        expr, value = tool_problem(rng)
        if expr not in seen:
            seen.add(expr)
            problems.append((expr, value))
    rl_train, rl_eval, sft = problems[:2000], problems[2000:2200], problems[2200:]
    write_jsonl(data_dir / "tool_arithmetic" / "train.jsonl", [rl_row(*p) for p in rl_train])
    write_jsonl(data_dir / "tool_arithmetic" / "eval.jsonl", [rl_row(*p) for p in rl_eval])
    write_jsonl(data_dir / "tool_arithmetic_sft" / "train.jsonl",
                [tool_sft_row(*p, rng.random() < TOOL_FRACTION) for p in sft])
    write_jsonl(data_dir / "tool_arithmetic_sft" / "eval.jsonl",
                [tool_sft_row(*p, True) for p in rl_eval])


def _render(messages: list[dict]) -> str:
    """The text as the chat template lays it out, so role headers become tokens of their own."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def _messages(row: dict) -> list[dict]:
    return row.get("messages") or row["prompt"] + row.get("chosen", []) + row.get("rejected", [])


# --- tokenizer ----------------------------------------------------------------------------------

def make_tokenizer(corpus: list[str], out_dir: Path, vocab_size: int = MAX_VOCAB_SIZE) -> None:
    """Train a byte-level BPE on `corpus` and save it in Hugging Face format.

    Offsets are left untrimmed (`trim_offsets=False`, as Qwen's tokenizer does) so that loss
    masks can be placed by character offsets.

    `<think>`/`</think>` are added as non-special tokens, as Qwen3 does: they stay atomic but are
    ordinary content that an assistant message may contain (and that decoding keeps).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS, IM_START, IM_END]
    think = [THINK_OPEN, THINK_CLOSE]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(think), min_frequency=1,
                                  show_progress=False, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in think])

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                 additional_special_tokens=[IM_START, IM_END])
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 4096
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        old.unlink()
    hf.save_pretrained(str(out_dir))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ASSETS,
                        help="assets directory to (re)write (default: %(default)s)")
    out = parser.parse_args(argv).out
    corpus = make_datasets(out / "data")
    make_tokenizer(corpus, out / "tokenizer")
    from posttrain.data.synthetic import write_event_dataset   # no text: not in the corpus
    write_event_dataset(out / "data" / "events")
    from eval_samples import GSM8K_SAMPLE, MC_SAMPLE           # hand-written; not in the corpus
    write_jsonl(out / "data" / "eval" / "gsm8k_sample.jsonl", GSM8K_SAMPLE)
    write_jsonl(out / "data" / "eval" / "mc_sample.jsonl", MC_SAMPLE)
    for path in sorted(out.rglob("*")):
        if path.is_file():
            print(f"{path.relative_to(out)}  {path.stat().st_size:>9,d} bytes")


if __name__ == "__main__":
    main()
