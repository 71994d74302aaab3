"""Train kvlab's tiny Llama on Python's own documentation and the workbook's prose, on a CPU, from a seed.

    .venv/bin/python scripts/train_tiny_model.py                 # the committed recipe -> data/tiny-pydoc-llama/
    .venv/bin/python scripts/train_tiny_model.py --steps 3 --out /tmp/m   # a smoke run (tests do this)

Nothing is downloaded: the corpus is the standard library's ``pydoc_data.topics`` (the reference
pages ``help("assert")`` prints, ~465,000 characters), each page one chat turn (system prompt, a
question made from its title, the page as the answer), plus the workbook's prose (README.md,
GLOSSARY.md, the notebooks' markdown cells) read from git at ``PROSE_REVISION``, so the recipe holds
still while the prose moves on. A byte-level BPE (``tokenizers``), then a ``transformers``
``LlamaForCausalLM`` (GQA, 2 KV heads) trained with AdamW; seeded, on a fixed number of threads, so a
rerun on the same CPU, Python and torch writes the same bytes. The folder written is a Hugging Face
checkpoint plus ``recipe.json`` (settings, corpus hash, losses, times, load, machine) and a README
made from it. One file on purpose, longer than kvlab's modules: the recipe reads top to bottom.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the Rust side would pick its own thread count

import torch  # noqa: E402 - after the environment above

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "data" / "tiny-pydoc-llama"
#: The commit whose prose the committed model read (main when the recipe was fixed).
PROSE_REVISION = "976cfb75ee2dd397d862c4a863613b7b53af9120"
PROSE_FILES = ("README.md", "GLOSSARY.md", *(f"notebooks/{name}.ipynb" for name in (
    "01_bytes_per_token", "02_budget_simulator", "03_block_table", "04_prefix_cache", "05_paged_attention_kernel",
    "06_end_to_end", "07_beyond_one_gpu")))
SYSTEM_PROMPT = "You are a helpful assistant for Python's documentation."
EOS, SYSTEM, USER, ASSISTANT = "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (EOS, SYSTEM, USER, ASSISTANT)  # ids 0..3
QUESTIONS = (
    "What does the documentation say about {title}?",
    "Explain {title}.",
    "Tell me about {title}.",
    "How does {title} work in Python?",
    "Can you describe {title}?",
)
#: The chat template transformers renders (``apply_chat_template``): exactly the training format.
#: Newlines are written as ``{{ '\\n' }}``: transformers' Jinja drops a newline right after a block tag.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ '\\n' }}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}<|endoftext|>{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Every choice that decides the checkpoint; ``recipe.json`` records it."""

    seed: int = 0
    steps: int = 1000
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    context: int = 512
    batch_size: int = 8
    learning_rate: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    held_out_topics: int = 4
    threads: int = 2
    prose_revision: str = PROSE_REVISION
    eval_every: int = 200


# --------------------------------------------------------------------------- the corpus


def chat_text(question: str, answer: str, system: str = SYSTEM_PROMPT) -> str:
    """One chat turn as the model reads it (``CHAT_TEMPLATE`` rendered, answer and end token included)."""
    return f"{SYSTEM}\n{system}\n{USER}\n{question}\n{ASSISTANT}\n{answer}{EOS}"


def topic_title(text: str) -> str:
    """A pydoc page's title (its first line) as it reads mid-sentence: 'The "if" statement' -> 'the "if" ...'."""
    title = text.splitlines()[0].strip()
    return title[0].lower() + title[1:] if len(title) > 1 and title[1].islower() else title


def pydoc_topics() -> list[tuple[str, str]]:
    """``(key, page)`` for every distinct page of ``pydoc_data.topics`` ('if' and 'else' share one), sorted."""
    from pydoc_data.topics import topics

    seen, pages = set(), []
    for key in sorted(topics):
        text = topics[key].strip()
        if text not in seen:
            seen.add(text)
            pages.append((key, text))
    return pages


def read_prose(revision: str, files: Sequence[str] = PROSE_FILES) -> list[str]:
    """The workbook's prose at a git ``revision`` (markdown files whole, notebooks' markdown cells), one text per file.

    ``revision="worktree"`` reads the files as they are checked out instead (for trying a new recipe).
    """
    texts = []
    for name in files:
        if revision == "worktree":
            raw = (ROOT / name).read_text(encoding="utf-8")
        else:
            done = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{name}"], capture_output=True)
            if done.returncode:
                raise SystemExit(f"cannot read {name} at --prose-rev {revision} ({done.stderr.decode().strip()}); "
                                 "a shallow clone lacks old commits: fetch them, or pass --prose-rev worktree")
            raw = done.stdout.decode("utf-8")
        if name.endswith(".ipynb"):
            cells = json.loads(raw)["cells"]
            raw = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        texts.append(raw.strip())
    return texts


@dataclasses.dataclass
class Corpus:
    """Training topics, held-out topics and prose, plus what identifies them."""

    train_topics: list[tuple[str, str]]
    held_out: list[tuple[str, str]]
    prose: list[str]

    def documents(self, epoch: int, seed: int) -> list[str]:
        """One epoch: every document once, shuffled, each topic asked with a freshly drawn question."""
        rng = random.Random(f"kvlab-corpus-{seed}-{epoch}")
        docs = [chat_text(rng.choice(QUESTIONS).format(title=topic_title(page)), page)
                for _, page in self.train_topics]
        docs += [text + EOS for text in self.prose]
        rng.shuffle(docs)
        return docs

    def validation_documents(self) -> list[str]:
        return [chat_text(QUESTIONS[0].format(title=topic_title(page)), page) for _, page in self.held_out]

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for part in (*(k + p for k, p in self.train_topics), "--", *(k + p for k, p in self.held_out), "--",
                     *self.prose):
            digest.update(part.encode("utf-8") + b"\0")
        return digest.hexdigest()

    def num_chars(self) -> int:
        return sum(len(p) for _, p in self.train_topics + self.held_out) + sum(len(t) for t in self.prose)


def build_corpus(recipe: Recipe) -> Corpus:
    """Pick the held-out topics by seed; the rest train."""
    topics = pydoc_topics()
    held = set(random.Random(f"kvlab-held-out-{recipe.seed}").sample(range(len(topics)), recipe.held_out_topics))
    return Corpus([t for i, t in enumerate(topics) if i not in held], [t for i, t in enumerate(topics) if i in held],
                  read_prose(recipe.prose_revision))


# --------------------------------------------------------------------------- tokenizer and batches


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) with the chat's special tokens as ids 0-3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """The texts' tokens end to end, as one int64 stream."""
    ids = [i for enc in tokenizer.encode_batch(list(texts)) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, context: int, offset: int = 0) -> torch.Tensor:
    """Non-overlapping ``[num_windows, context]`` windows of a stream, starting at ``offset``."""
    usable = (len(stream) - offset) // context
    return stream[offset:offset + usable * context].view(usable, context)


def training_batches(corpus: Corpus, tokenizer, recipe: Recipe) -> Iterator[torch.Tensor]:
    """``[batch_size, context]`` batches, epoch after epoch: shuffled documents, a random offset, shuffled windows."""
    pending: list[torch.Tensor] = []
    for epoch in range(sys.maxsize):
        g = torch.Generator().manual_seed(recipe.seed * 1_000_003 + epoch)
        stream = encode(tokenizer, corpus.documents(epoch, recipe.seed))
        offset = int(torch.randint(recipe.context, (1,), generator=g))
        chunk = windows(stream, recipe.context, offset)
        pending.extend(chunk[torch.randperm(len(chunk), generator=g)])
        while len(pending) >= recipe.batch_size:
            batch, pending = pending[:recipe.batch_size], pending[recipe.batch_size:]
            yield torch.stack(batch)


# --------------------------------------------------------------------------- model and training


def model_config(recipe: Recipe):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, head_dim=recipe.hidden_size // recipe.num_attention_heads,
        max_position_embeddings=recipe.context, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=0, pad_token_id=0,
    )


def learning_rate(recipe: Recipe, step: int) -> float:
    """Linear warm-up, then a cosine down to ``min_lr_ratio`` of the peak."""
    if step < recipe.warmup_steps:
        return recipe.learning_rate * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    floor = recipe.min_lr_ratio
    return recipe.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def mean_loss(model, batches: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss (nats) over ``[n, context]`` windows, with every prediction weighted alike."""
    model.eval()
    total = 0.0
    for start in range(0, len(batches), batch_size):
        x = batches[start:start + batch_size]
        total += float(model(input_ids=x, labels=x).loss) * len(x)
    model.train()
    return total / len(batches)


def say(line: str) -> None:
    print(line, flush=True)


def train(recipe: Recipe, log=say, eval_windows: int | None = None) -> tuple[object, object, Corpus, dict]:
    """Build the corpus and tokenizer, train the model; return (model, tokenizer, corpus, history).

    The held-out loss is measured on all held-out windows, or the first ``eval_windows`` (a quick run).
    """
    from transformers import LlamaForCausalLM

    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    corpus = build_corpus(recipe)
    tokenizer = train_tokenizer(corpus.documents(0, recipe.seed), recipe.vocab_size)
    model = LlamaForCausalLM(model_config(recipe)).float()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=recipe.learning_rate, betas=(0.9, 0.95), eps=1e-8)
    val = windows(encode(tokenizer, corpus.validation_documents()), recipe.context)[:eval_windows]
    history: dict = {"loss": [], "val": [], "load": []}
    batches = training_batches(corpus, tokenizer, recipe)
    model.train()
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        x = next(batches)                                       # [batch_size, context]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history["loss"].append(round(loss.item(), 4))
        if step % 50 == 0:                                      # the machine may be shared: record how busy
            history["load"].append(round(os.getloadavg()[0], 2))
        if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
            history["val"].append((step + 1, round(mean_loss(model, val, recipe.batch_size), 4)))
            log(f"step {step + 1}/{recipe.steps}  loss {loss:.3f}  held-out {history['val'][-1][1]:.3f}")
    return model, tokenizer, corpus, history


# --------------------------------------------------------------------------- the checkpoint


def save_checkpoint(model, tokenizer, out: Path) -> None:
    """Write weights (bfloat16, to keep the folder small), config, generation config and tokenizer files."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(eos_token_id=0, pad_token_id=0, do_sample=False)
    model.to(torch.bfloat16).save_pretrained(out)
    model.float()                                       # keeps the bfloat16-rounded values: what was saved
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS,
                                   additional_special_tokens=[SYSTEM, USER, ASSISTANT],
                                   model_max_length=model.config.max_position_embeddings)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # Also readable by transformers 4 (pyproject allows >= 4.45): its class name, its key for the extra
    # special tokens, and the chat template inside tokenizer_config.json as well as in chat_template.jinja.
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.pop("extra_special_tokens", None)
    config.update(tokenizer_class="PreTrainedTokenizerFast", additional_special_tokens=[SYSTEM, USER, ASSISTANT],
                  chat_template=CHAT_TEMPLATE)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def greedy_samples(model, tokenizer, prompts: Sequence[str], max_new_tokens: int) -> list[dict]:
    """What the saved model writes for each prompt, greedily (transformers' ``generate``)."""
    model.eval()
    samples = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        samples.append({"prompt": prompt, "completion": tokenizer.decode(out[0, ids.shape[1]:].tolist(),
                                                                         skip_special_tokens=False)})
    return samples


def title_recall(model, tokenizer, topics: Sequence[tuple[str, str]]) -> list[str]:
    """The pages whose title the model writes first when asked about them (``QUESTIONS[0]``, greedy)."""
    recalled = []
    for key, page in topics:
        title = page.splitlines()[0].strip()
        prompt = chat_text(QUESTIONS[0].format(title=topic_title(page)), "").removesuffix(EOS)
        answer = greedy_samples(model, tokenizer, [prompt], len(tokenizer.encode(title).ids) + 1)[0]["completion"]
        if answer.startswith(title):
            recalled.append(key)
    return recalled


def sample_prompts(corpus: Corpus) -> list[str]:
    """A trained topic, a held-out one, a question about the workbook, and plain text to continue."""
    trained = dict(corpus.train_topics)
    key = "for" if "for" in trained else corpus.train_topics[0][0]
    return [
        chat_text(QUESTIONS[0].format(title=topic_title(trained[key])), "").removesuffix(EOS),
        chat_text(QUESTIONS[2].format(title=topic_title(corpus.held_out[0][1])), "").removesuffix(EOS),
        chat_text("What is a block table?", "").removesuffix(EOS),
        "The KV cache",
    ]


# --------------------------------------------------------------------------- the run and its record


def run(recipe: Recipe, out: Path, command: str, sample_tokens: int = 60, eval_windows: int | None = None,
        log=say) -> dict:
    """Train, save, evaluate the saved weights, and record everything in ``recipe.json`` and README.md."""
    import tokenizers
    import transformers

    from kvlab.machine import describe_machine

    load_start, wall_start, cpu_start = os.getloadavg(), time.perf_counter(), time.process_time()
    model, tokenizer, corpus, history = train(recipe, log, eval_windows)
    wall_s, cpu_s, load_end = time.perf_counter() - wall_start, time.process_time() - cpu_start, os.getloadavg()
    save_checkpoint(model, tokenizer, out)
    first_epoch = windows(encode(tokenizer, corpus.documents(0, recipe.seed)), recipe.context)
    val = windows(encode(tokenizer, corpus.validation_documents()), recipe.context)[:eval_windows]
    summary = {
        "command": command,
        "recipe": dataclasses.asdict(recipe),
        "corpus": {
            "sha256": corpus.sha256(), "chars": corpus.num_chars(), "python": platform.python_version(),
            "pydoc_topics": len(corpus.train_topics) + len(corpus.held_out),
            "held_out_topics": [k for k, _ in corpus.held_out], "prose_revision": recipe.prose_revision,
            "prose_files": list(PROSE_FILES), "tokens_per_epoch": int(first_epoch.numel()),
            "epochs_seen": round(recipe.steps * recipe.batch_size / max(1, len(first_epoch)), 2),
        },
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss": {  # nats per token; the last two with the saved (bfloat16-rounded) weights, computed in float32
            "train_last_50_steps": round(sum(history["loss"][-50:]) / len(history["loss"][-50:]), 4),
            "train_windows_saved_weights": round(mean_loss(model, first_epoch[:min(32, eval_windows or 32)],
                                                           recipe.batch_size), 4),
            "held_out_saved_weights": round(mean_loss(model, val, recipe.batch_size), 4),
            "held_out_during_training": history["val"], "per_step": history["loss"],
        },
        "time": {"wall_s": round(wall_s, 1), "cpu_s": round(cpu_s, 1), "threads": recipe.threads,
                 "load_average_start": [round(x, 2) for x in load_start],
                 "load_average_end": [round(x, 2) for x in load_end],
                 "load_average_samples": history.pop("load"), "load_average_note": "1-minute, every 50 steps"},
        "machine": describe_machine(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "title_recall": {"trained": title_recall(model, tokenizer, corpus.train_topics[:eval_windows]),
                         "of_trained": len(corpus.train_topics[:eval_windows]),
                         "held_out": title_recall(model, tokenizer, corpus.held_out[:eval_windows])},
        "sample_tokens": sample_tokens,
        "samples": greedy_samples(model, tokenizer, sample_prompts(corpus), sample_tokens),
    }
    summary["files"] = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.suffix != ".md"
                        and p.name != "recipe.json"}
    summary["model_sha256"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    (out / "recipe.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "README.md").write_text(readme_text(summary), encoding="utf-8")
    return summary


def readme_text(s: dict) -> str:
    """The checkpoint's README: how it was made, from ``recipe.json``'s own numbers."""
    r, c, loss, t, m = s["recipe"], s["corpus"], s["loss"], s["time"], s["machine"]
    best = min(loss["held_out_during_training"], key=lambda step_loss: step_loss[1])
    loads, recall = t["load_average_samples"], s["title_recall"]
    sizes = ", ".join(f"`{name}` {size / 2**20:.2f} MiB" if size > 2**20 else f"`{name}` {size / 1024:.1f} KiB"
                      for name, size in s["files"].items())
    samples = "\n".join(f"* prompt `{x['prompt']!r}`\n\n  ```text\n  {x['completion']!r}\n  ```" for x in s["samples"])
    return f"""# tiny-pydoc-llama: a {s['parameters'] / 1e6:.1f}M-parameter Llama trained on Python's documentation

Made by `scripts/train_tiny_model.py` (everything below comes from its `recipe.json`), so that the
workbook serves a model that writes text without downloading anything. Load it with
`LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)` and `AutoTokenizer.from_pretrained(path)`,
or `kvlab.engine.LLMEngine(path)`. The weights are stored in bfloat16 (to keep the folder small);
compute in float32 on a CPU.

## How it was made

* Command: `{s['command']}` (seed {r['seed']}, {r['threads']} torch threads).
* Corpus: {c['chars']:,} characters, sha256 `{c['sha256'][:16]}…`: the {c['pydoc_topics']} distinct pages of
  Python {c['python']}'s `pydoc_data.topics`, each as one chat turn (system prompt
  "{SYSTEM_PROMPT}", a question made from the page title, the page as the answer), and the
  workbook's prose ({", ".join(c['prose_files'])}) read from git at `{c['prose_revision'][:12]}`. Another Python
  version ships other pages: the hash says whether a rerun read the same text. Held out (never trained on):
  {", ".join(f"`{k}`" for k in c['held_out_topics'])}.
* Tokenizer: byte-level BPE (`tokenizers`), vocabulary {r['vocab_size']}, special tokens
  {", ".join(f"`{x}`" for x in SPECIAL_TOKENS)} (ids 0-3; `{EOS}` ends documents and answers).
  One epoch is {c['tokens_per_epoch']:,} tokens.
* Model: `LlamaForCausalLM`, {r['num_hidden_layers']} layers, hidden {r['hidden_size']}, MLP {r['intermediate_size']},
  {r['num_attention_heads']} query heads and {r['num_key_value_heads']} KV heads (GQA) of
  {r['hidden_size'] // r['num_attention_heads']}, context {r['context']}, tied embeddings;
  {s['parameters']:,} parameters.
* Training: {r['steps']} AdamW steps of {r['batch_size']} x {r['context']} tokens (about {c['epochs_seen']} epochs),
  peak learning rate {r['learning_rate']} after {r['warmup_steps']} warm-up steps, cosine to {r['min_lr_ratio']} of it,
  weight decay {r['weight_decay']}, gradient clipping {r['grad_clip']}.
* Time: {t['wall_s']:.0f} s wall, {t['cpu_s']:.0f} s CPU on {m['cpu']} ({m['cores']} cores), shared with other
  jobs: load average {min(loads)}-{max(loads)}, median {statistics.median(loads)} ({t['load_average_note']});
  Python {m['python']}, torch {s['versions']['torch']}, transformers {s['versions']['transformers']},
  tokenizers {s['versions']['tokenizers']}, {m['date']}.{"".join(
      f" Rerun on {x['date']} at load average {min(x['load_average_samples'])}-{max(x['load_average_samples'])}:"
      f" {x['wall_s']:.0f} s wall, {x['cpu_s']:.0f} s CPU, the same `model.safetensors` byte for byte."
      for x in t.get("reruns", []))}
* Files: {sizes}.

## How good it is

Loss in nats per token: {loss['train_last_50_steps']} over the last 50 training steps; with the saved
weights {loss['train_windows_saved_weights']} on training text and {loss['held_out_saved_weights']} on the held-out
pages, which was lowest ({best[1]}) at step {best[0]} and rose as training went on. The model memorises rather than
generalises: a few million parameters made {c['epochs_seen']} passes over a small corpus. After the system prompt
and a question it answers with a page title, its underline and reference-manual prose and grammar rules, but
often not the page asked about: asked "{QUESTIONS[0].format(title='...')}" of every trained page, it began with
that page's own title for {len(recall['trained'])} of {recall['of_trained']} ({", ".join(recall['trained'])}) and for
{len(recall['held_out'])} of the {len(c['held_out_topics'])} held-out pages. Its sentences drift from page to page. It
does not reason, stay factual, or know anything outside its corpus: it is there so the workbook can show text,
not to teach Python.
Prompts in the training format come from the chat template:
`tokenizer.apply_chat_template([{{"role": "system", "content": ...}}, {{"role": "user", "content": ...}}],
tokenize=False, add_generation_prompt=True)`. Greedy samples (transformers `generate`,
{len(s['samples']) and s['sample_tokens']} new tokens at most):

{samples}
"""


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = Recipe()
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the checkpoint folder to write")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads (results depend on it)")
    parser.add_argument("--prose-rev", default=defaults.prose_revision,
                        help="git revision to read the workbook's prose at, or 'worktree'")
    parser.add_argument("--sample-tokens", type=int, default=60, help="greedy tokens per sample in the README")
    parser.add_argument("--eval-windows", type=int, help="evaluate on this many windows (and pages) only: quick runs")
    parser.add_argument("--readme-only", action="store_true", help="rewrite --out's README from its recipe.json")
    args = parser.parse_args(argv)
    if args.readme_only:
        summary = json.loads((args.out / "recipe.json").read_text(encoding="utf-8"))
        (args.out / "README.md").write_text(readme_text(summary), encoding="utf-8")
        return summary
    # A short run keeps the schedule's start (warm-up does not depend on the step count), so its steps
    # are the committed run's first steps; it evaluates once, at its end.
    recipe = dataclasses.replace(defaults, steps=args.steps, seed=args.seed, threads=args.threads,
                                 prose_revision=args.prose_rev, eval_every=min(defaults.eval_every, args.steps))
    command = "python scripts/train_tiny_model.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    summary = run(recipe, args.out, command, args.sample_tokens, args.eval_windows)
    print(f"wrote {args.out}: {summary['parameters'] / 1e6:.2f}M parameters, held-out loss "
          f"{summary['loss']['held_out_saved_weights']}, {summary['time']['wall_s']} s wall, "
          f"{summary['time']['cpu_s']} s CPU")
    return summary


if __name__ == "__main__":
    main()
