"""GRPO on CPU: completions per second of generation + update, ours against TRL's GRPOTrainer (issue 63).

Needs TRL: `pip install trl==1.16.0` (it is no dependency of the project; without it this script says so in one
line and exits 2). One process, fp32, the same tiny Llama on both sides: transformers' LlamaForCausalLM for TRL
and the same weights loaded into ours through runtime/convert (from_hf), checked by comparing their logits.

Both sides get the same P prompts per step (random words of a word-level tokenizer, all of the same length), G
completions each, sampled at temperature 1.0 to exactly max_completion_length tokens (the eos id cannot be sampled:
TRL through `min_new_tokens`, ours through generate's `vocab_size`, which both leave every other token's odds as
they are), the same reward (the share of a completion's words that are even-numbered), beta 0, loss_type dapo,
AdamW at TRL's defaults (lr 1e-6, no weight decay), the gradient clipped at 1.0, all P x G rows in one micro-batch.
A step of ours is runtime/rl/rollout.py's rollout() and runtime/step.py's train_step; a step of TRL is one step of
trainer.train(), timed by a callback from on_step_begin to on_step_end. The two run interleaved, step by step: the
callback runs one step of ours after each of TRL's, so load from elsewhere on the machine hits both alike. The
first step of each side is a warm-up, left out.

    pip install trl==1.16.0
    python benchmarks/grpo.py                                 # P=4 prompts x G=8, 32 tokens, 10 timed steps
    python benchmarks/grpo.py --prompts 2 --generations 4 --steps 3 --completion-length 16   # a quick look
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from runtime.convert import from_hf  # noqa: E402
from runtime.generate import generate  # noqa: E402
from runtime.models import ModelConfig, build_model  # noqa: E402
from runtime.parallel import (AdamWConfig, DataParallelConfig, ParallelDims, ShardedAdamW, Topology,  # noqa: E402
                              parallelize_model)
from runtime.rl import rollout as rollout_module  # noqa: E402
from runtime.rl.grpo import GRPOConfig, GRPOObjective  # noqa: E402
from runtime.rl.rollout import micro_batches, rollout  # noqa: E402
from runtime.step import train_step  # noqa: E402

LR, CLIP = 1e-6, 1.0  # TRL's GRPOConfig learning_rate and TrainingArguments' max_grad_norm
PAD, EOS = "<pad>", "<eos>"


def even_share(text: str) -> float:
    """The reward: the share of the completion's words that are even-numbered ("w12" is, "w7" is not)."""
    words = text.split()
    return sum(1 for w in words if w[1:].isdigit() and int(w[1:]) % 2 == 0) / max(len(words), 1)


def trl_reward(prompts, completions, **kwargs) -> list[float]:
    return [even_share(text) for text in completions]


def our_reward(completion: str, answer: str) -> float:
    return even_share(completion)


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer of vocab_size ids: words w0, w1, ... then <pad> and, last, <eos> (so an eos id can be
    cut from the sampled vocabulary by generate's vocab_size)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab[PAD], vocab[EOS] = vocab_size - 2, vocab_size - 1
    core = Tokenizer(WordLevel(vocab, unk_token=PAD))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS)


def build_hf_model(args):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=args.vocab - 1, pad_token_id=args.vocab - 2)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def build_ours(hf_model, vocab: int):
    """Our model with the HF model's weights (runtime/convert), parallelized for one process, and its AdamW."""
    state, keys = from_hf(hf_model.state_dict(), hf_model.config.to_dict(), tokenizer_vocab_size=vocab)
    model = build_model(ModelConfig.from_model_section(keys, vocab))
    model.load_state_dict(state, strict=True)
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))  # no process group: a single process
    model = parallelize_model(model, topo, data_parallel=DataParallelConfig("fp32", False))
    optimizer = ShardedAdamW(model, AdamWConfig(lr=LR, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8))
    return model, optimizer, topo


@torch.no_grad()
def logits_gap(hf_model, model, ids: torch.Tensor) -> float:
    """The largest difference between the two models' logits on `ids` (the same weights: float noise only)."""
    hf_model.eval(), model.eval()
    try:
        return (hf_model(ids).logits - model(ids)[..., :hf_model.config.vocab_size]).abs().max().item()
    finally:
        hf_model.train(), model.train()


class Timed:
    """A callable that adds its wall time to `seconds` (generation on both sides, TRL's rollout)."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


class OurSide:
    """One GRPO step of ours per call: rollout() (generation, rewards, old log-probs), then train_step."""

    def __init__(self, model, optimizer, topo, tokenizer, prompts: list[list[int]], args):
        self.model, self.optimizer, self.topo, self.prompts, self.args = model, optimizer, topo, prompts, args
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # as TRL decodes
        self.config = GRPOConfig(num_generations=args.generations, max_completion_length=args.completion_length,
                                 temperature=1.0, beta=0.0, loss_type="dapo")
        # rollout() calls the module's sample(): timing it there splits the rollout into generation and the rest.
        self.sample = Timed(rollout_module.sample)
        rollout_module.sample = self.sample
        self.steps: list[dict] = []
        self.lengths: set[int] = set()

    def step(self, index: int) -> None:
        P, args = self.args.prompts, self.args
        first = index * P % len(self.prompts)
        prompts = [self.prompts[(first + i) % len(self.prompts)] for i in range(P)]
        generation_before = self.sample.seconds
        start = time.perf_counter()
        batch = rollout(self.model, prompts, [""] * P, config=self.config, reward=our_reward, decode=self.decode,
                        stop_ids=(), topo=self.topo, seed=index, prompt_indices=list(range(first, first + P)),
                        micro_batch_size=P * args.generations, pad_id=args.vocab - 2, vocab_size=args.vocab - 1)
        rolled = time.perf_counter()
        train_step(self.model, self.optimizer, micro_batches(batch, P * args.generations), self.topo, lr=LR,
                   clip=CLIP, objective=GRPOObjective(self.config, batch.table))
        end = time.perf_counter()
        self.lengths |= {len(c) for c in batch.completions}
        generation = self.sample.seconds - generation_before
        self.steps.append({"total": end - start, "generation": generation, "rollout_rest": rolled - start - generation,
                           "update": end - rolled, "reward": batch.table.rewards.mean().item(),
                           "one_call": self.one_call(prompts, index)})

    def one_call(self, prompts: list[list[int]], index: int) -> float:
        """Seconds of generate() over all P x G rows in one call with one seed, as TRL generates (rollout() makes one
        call too, each prompt's rows from their own generator): not part of the step, it shows what that costs."""
        rows = [p for p in prompts for _ in range(self.args.generations)]
        start = time.perf_counter()
        generate(self.model, rows, max_new_tokens=self.args.completion_length, temperature=1.0, seed=index,
                 pad_id=self.args.vocab - 2, vocab_size=self.args.vocab - 1)
        return time.perf_counter() - start


def trl_trainer(hf_model, tokenizer, prompts: list[str], args, out_dir: str, ours: OurSide):
    """TRL's GRPOTrainer on the same model, prompts and reward, with a callback that times each step and then runs
    one step of ours."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    rows = args.prompts * args.generations
    config = TRLConfig(
        output_dir=out_dir, per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.completion_length, temperature=1.0, beta=0.0,
        loss_type="dapo", max_steps=args.steps + 1, use_cpu=True, bf16=False, fp16=False, report_to=[],
        logging_steps=args.steps + 1, save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": args.completion_length})  # eos can't be sampled: every row full length

    class Interleave(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []
            self.start = 0.0

        def on_step_begin(self, args_, state, control, **kwargs):
            self.before = (hf_generate.seconds, trl_rollout.seconds)
            self.start = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            total = time.perf_counter() - self.start
            generation, rolled = hf_generate.seconds - self.before[0], trl_rollout.seconds - self.before[1]
            self.steps.append({"total": total, "generation": generation, "rollout_rest": rolled - generation,
                               "update": total - rolled})
            ours.step(len(self.steps) - 1)

    hf_generate = Timed(hf_model.generate)
    hf_model.generate = hf_generate  # TRL calls the unwrapped model's generate (one process: the model itself)
    callback = Interleave()
    trainer = GRPOTrainer(model=hf_model, reward_funcs=[trl_reward], args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                          callbacks=[callback])
    # TRL's rollout: generation, rewards and advantages (the old log-probs too, when it needs them).
    trl_rollout = Timed(trainer._generate_and_score_completions)
    trainer._generate_and_score_completions = trl_rollout
    return trainer, callback


def median(steps: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in steps[1:])  # the first step is the warm-up


def report(args, trl_steps: list[dict], ours: OurSide, trl_lengths: dict) -> None:
    rows, sides = args.prompts * args.generations, {"ours (rollout + train_step)": ours.steps,
                                                    "TRL GRPOTrainer": trl_steps}
    print(f"# completion lengths: ours {sorted(ours.lengths)}, TRL {trl_lengths}")
    print(f"# mean reward of the timed steps, ours: {statistics.mean(s['reward'] for s in ours.steps[1:]):.3f}")
    print(f"# load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n")
    print("| side | completions/s | s/step | generation s | rest of the rollout s | update s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, steps in sides.items():
        cells = " | ".join(f"{median(steps, key):.3f}" for key in ("total", "generation", "rollout_rest", "update"))
        print(f"| {name} | {rows / median(steps, 'total'):.1f} | {cells} |")
    ratio = {key: median(trl_steps, key) / median(ours.steps, key) for key in ("total", "generation", "update")}
    paired = statistics.median(t["total"] / o["total"] for t, o in zip(trl_steps[1:], ours.steps[1:]))
    print(f"\nours / TRL, completions/s: {ratio['total']:.2f} (paired, the median of the per-step ratios: "
          f"{paired:.2f}); generation alone {ratio['generation']:.2f}, update alone {ratio['update']:.2f}")
    one_call = median(ours.steps, "one_call")
    print(f"ours' generate() over all {rows} rows in one call (not in the step): {one_call:.3f} s, "
          f"{median(trl_steps, 'generation') / one_call:.2f}x TRL's generation speed")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="P, prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--prompt-length", type=int, default=8, help="words per prompt (every prompt the same)")
    parser.add_argument("--completion-length", type=int, default=32, help="max_completion_length")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side, after one warm-up step")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=352)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256, help="words + <pad> + <eos>")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides run in this process)")
    return parser.parse_args()


def main() -> None:
    try:
        import trl
    except ImportError:
        print("benchmarks/grpo.py needs TRL: pip install trl==1.16.0", file=sys.stderr)
        sys.exit(2)
    args = parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"{args.threads} thread(s); Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, ffn "
          f"{args.ffn}, vocab {args.vocab}; P={args.prompts} x G={args.generations}, prompt {args.prompt_length} + "
          f"completion {args.completion_length} tokens, {args.steps} timed steps", flush=True)
    print(f"# load average at the start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    tokenizer = build_tokenizer(args.vocab)
    words = torch.randint(0, args.vocab - 2, (args.prompts * (args.steps + 1), args.prompt_length),
                          generator=torch.Generator().manual_seed(1))
    texts = [" ".join(f"w{i}" for i in row) for row in words.tolist()]
    prompt_ids = [tokenizer.encode(text) for text in texts]
    assert prompt_ids == words.tolist(), "the tokenizer maps w<i> to id i"
    hf_model = build_hf_model(args)
    model, optimizer, topo = build_ours(hf_model, args.vocab)
    print(f"# the same weights: largest logit difference {logits_gap(hf_model, model, words[:4]):.2e}", flush=True)
    ours = OurSide(model, optimizer, topo, tokenizer, prompt_ids, args)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer, callback = trl_trainer(hf_model, tokenizer, texts, args, out_dir, ours)
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "completions/min_length" in entry]
    trl_lengths = {key: logged[-1][f"completions/{key}"] for key in ("min_length", "max_length")} if logged else {}
    report(args, callback.steps, ours, trl_lengths)


if __name__ == "__main__":
    main()
