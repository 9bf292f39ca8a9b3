"""Can a small Qwen3-VL learn the 9x9 maze from pixels by supervised next-move training? Measure it.

Standalone (argparse, no Hydra): torch, transformers, numpy, PIL and the light rlexp modules only.

    PYTHONPATH=. python3 bench/sft_pixels.py --out /tmp/run --time-budget-s 420 [--bench]

What it does:
- builds a Qwen3-VL from a config (sizes on the command line) with the tiny model's locally made
  tokenizer and processor (``rlexp.models.tiny``), from scratch, fp32 master weights + bf16 autocast;
- a pool of training mazes (the project's generator, seeds of ``TrainingMazeStream``'s rule, every
  pinned easy *grid* excluded whatever its corner pairing), BFS next-move tables computed on the device;
- each sample is a random (maze, agent cell) state (on the expert path with ``--onpath-frac``, else any
  free cell), a random turn k and previous feedback, and the target is the BFS expert's move (``stop``
  on the goal); the sequence is the rollout's own one-image turn context (``history_window=1``) with
  the reply (action token + ``<|im_end|>``), loss on both reply tokens;
- frames are drawn and patchified on the device (``rlexp.envs.gpu_frames``); the model runs through
  ``rlexp.models.fast_policy.FastTurnForward`` (fixed M-RoPE ids, one vision attention call per block);
- every ``--eval-every-s`` seconds: closed-loop greedy eval on the pinned 64 easy mazes, <= 20 steps,
  argmax over the 5 action tokens, true success = stop on the goal (also: how often the full-vocabulary
  argmax is an action token);
- saves HF checkpoints (bf16 model + processor, re-evaluated as saved): the first whose success is in
  ``--warm-range`` and the last, each as one tar split into parts of < 16 MiB under ``--out``.

``--bench`` first times a train step at several batch sizes for three paths: plain transformers
(``model.model(...)``: M-RoPE ids computed per sample, vision attention per image), transformers with
the fixed position ids passed, and the fast path.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _light_imports() -> None:
    """Import rlexp.envs.* / rlexp.models.* submodules without their package __init__ (which pull in
    gymnasium, peft, ...): the GPU machine has torch/transformers/numpy/PIL only."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import rlexp  # noqa: F401

    for name in ("rlexp.envs", "rlexp.models"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(ROOT / Path(*name.split(".")))]
            sys.modules[name] = mod


if "--check-rollout" not in sys.argv:
    _light_imports()
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rlexp.envs.gpu_frames import FrameEncoder  # noqa: E402
from rlexp.envs.maze import ACTION_DELTAS, generate_maze  # noqa: E402
from rlexp.envs.pinned import load_pinned  # noqa: E402
from rlexp.models.fast_policy import FastTurnForward, TurnLayout, freeze_vision_pos_embed  # noqa: E402

SIZE, MAX_STEPS, CELL_PX = 9, 20, 32
STOP = 4
LOG = None


def log(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    if LOG is not None:
        LOG.write(line + "\n")
        LOG.flush()


# ----------------------------------------------------------------------------------------------
# maze pool


def _gen_chunk(args):
    size, seeds, excluded = args
    walls, starts, goals = [], [], []
    for s in seeds:
        m = generate_maze(size, int(s))
        if m.grid.tobytes() in excluded:
            continue
        walls.append(m.grid)
        starts.append(m.start)
        goals.append(m.goal)
    return np.array(walls, dtype=bool), np.array(starts), np.array(goals)


def pinned_grids(size: int) -> set[bytes]:
    grids = set()
    for name in ("maze_easy", "maze_hard"):
        for m in load_pinned(name):
            if m.size == size:
                grids.add(m.grid.tobytes())
    return grids


def build_pool(n: int, stream_seed: int, workers: int):
    """n mazes of seeds (stream_seed + 1) * 2**32 + i (TrainingMazeStream's seeds), minus pinned grids."""
    import multiprocessing as mp

    excluded = pinned_grids(SIZE)
    base = (stream_seed + 1) << 32
    chunk = 5000
    jobs = [(SIZE, range(base + i, base + min(i + chunk, n)), excluded) for i in range(0, n, chunk)]
    t = time.time()
    if workers > 1:
        with mp.get_context("fork").Pool(workers) as pool:
            parts = pool.map(_gen_chunk, jobs)
    else:
        parts = [_gen_chunk(j) for j in jobs]
    walls = np.concatenate([p[0] for p in parts])
    starts = np.concatenate([p[1] for p in parts])
    goals = np.concatenate([p[2] for p in parts])
    log(f"pool: {len(walls)} mazes from {n} seeds ({n - len(walls)} pinned grids skipped) in {time.time() - t:.1f} s, {workers} workers")
    return walls, starts, goals


def load_or_build_pool(path: str | None, n: int, stream_seed: int, workers: int):
    if path and os.path.exists(path):
        z = np.load(path)
        walls = np.unpackbits(z["walls"], axis=1)[:, : SIZE * SIZE].reshape(-1, SIZE, SIZE).astype(bool)
        log(f"pool: loaded {len(walls)} mazes from {path}")
        return walls[:n], z["starts"][:n], z["goals"][:n]
    walls, starts, goals = build_pool(n, stream_seed, workers)
    if path:
        np.savez_compressed(
            path, walls=np.packbits(walls.reshape(len(walls), -1), axis=1), starts=starts, goals=goals
        )
    return walls, starts, goals


def bfs_dist(walls: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(N, H, W) int BFS distances to ``target`` (N, 2); large on walls."""
    n, h, w = walls.shape
    inf = 10_000
    dist = torch.full((n, h + 2, w + 2), inf, dtype=torch.int32, device=walls.device)
    free = torch.zeros((n, h + 2, w + 2), dtype=torch.bool, device=walls.device)
    free[:, 1:-1, 1:-1] = ~walls
    rows = torch.arange(n, device=walls.device)
    dist[rows, target[:, 0] + 1, target[:, 1] + 1] = 0
    for _ in range(h * w // 2 + 2):
        nb = torch.minimum(
            torch.minimum(dist[:, :-2, 1:-1], dist[:, 2:, 1:-1]), torch.minimum(dist[:, 1:-1, :-2], dist[:, 1:-1, 2:])
        )
        inner = torch.minimum(dist[:, 1:-1, 1:-1], nb + 1)
        dist[:, 1:-1, 1:-1] = torch.where(free[:, 1:-1, 1:-1], inner, dist[:, 1:-1, 1:-1])
    return dist[:, 1:-1, 1:-1]


class Pool:
    """Mazes on the device with expert next-move tables and shortest-path masks."""

    def __init__(self, walls, starts, goals, device):
        self.walls = torch.as_tensor(walls, device=device)
        self.starts = torch.as_tensor(starts, device=device, dtype=torch.long)
        self.goals = torch.as_tensor(goals, device=device, dtype=torch.long)
        self.n = len(self.walls)
        dg = bfs_dist(self.walls, self.goals)
        ds = bfs_dist(self.walls, self.starts)
        total = dg[torch.arange(self.n, device=device), self.starts[:, 0], self.starts[:, 1]]
        self.free = ~self.walls
        self.on_path = self.free & (dg + ds == total[:, None, None])
        self.dist_goal = torch.where(self.free, dg, torch.full_like(dg, -1))
        # next move: the neighbour one step closer (order right, up, left, down); STOP on the goal
        move = torch.full(dg.shape, -1, dtype=torch.long, device=device)
        pad = F.pad(dg, (1, 1, 1, 1), value=10_000)
        h, w = dg.shape[1:]
        for a in (3, 2, 1, 0):  # reverse so the lowest action wins (ties cannot happen in a tree)
            dr, dc = (int(x) for x in ACTION_DELTAS[a])
            nb = pad[:, 1 + dr : 1 + dr + h, 1 + dc : 1 + dc + w]
            move = torch.where(self.free & (nb == dg - 1), torch.full_like(move, a), move)
        move = torch.where(self.free & (dg == 0), torch.full_like(move, STOP), move)
        self.next_move = move
        assert bool((self.next_move[self.free] >= 0).all()), "every free cell must have an expert move"
        self.path_len = total

    def sample(self, b: int, onpath_frac: float, gen: torch.Generator, max_goal_dist: int | None = None):
        dev = self.walls.device
        m = torch.randint(self.n, (b,), device=dev, generator=gen)
        use_on = torch.rand(b, device=dev, generator=gen) < onpath_frac
        wts = torch.where(use_on[:, None, None], self.on_path[m], self.free[m]).float()
        if max_goal_dist is not None:
            near = (self.dist_goal[m] >= 0) & (self.dist_goal[m] <= max_goal_dist)
            wts = wts * near
        cell = torch.multinomial(wts.view(b, -1), 1, generator=gen)[:, 0]
        agents = torch.stack([cell // SIZE, cell % SIZE], dim=1)
        target = self.next_move[m, agents[:, 0], agents[:, 1]]
        return self.walls[m], agents, self.goals[m], target


# ----------------------------------------------------------------------------------------------
# model


def make_model(processor, args, device):
    from transformers import Qwen3VLForConditionalGeneration

    from rlexp.models.tiny import tiny_config

    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    head_dim = args.text_hidden // args.text_heads
    half = head_dim // 2
    sec_hw = (half * 5) // 16  # Qwen3-VL 8B: [24, 20, 20] of 64
    mrope = [half - 2 * sec_hw, sec_hw, sec_hw]
    text = {
        "hidden_size": args.text_hidden,
        "intermediate_size": args.text_inter,
        "num_hidden_layers": args.text_layers,
        "num_attention_heads": args.text_heads,
        "num_key_value_heads": args.text_kv_heads,
        "head_dim": head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": mrope, "mrope_interleaved": True},
    }
    vision = {
        "depth": args.vis_depth,
        "hidden_size": args.vis_hidden,
        "intermediate_size": args.vis_inter,
        "num_heads": args.vis_heads,
    }
    config = tiny_config(tok, text, vision)
    torch.manual_seed(args.seed)
    model = Qwen3VLForConditionalGeneration(config).to(device=device, dtype=torch.float32)
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"], do_sample=False
    )
    return model


def load_model(path, device):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).to(device)


def count_params(model):
    vis = sum(p.numel() for p in model.model.visual.parameters())
    tot = sum(p.numel() for p in model.parameters())
    return tot, vis


# ----------------------------------------------------------------------------------------------
# evaluation


class PinnedEval:
    def __init__(self, encoder, layout, device):
        mazes = load_pinned("maze_easy")
        self.walls = torch.tensor(np.stack([m.grid for m in mazes]), device=device)
        self.starts = torch.tensor([m.start for m in mazes], device=device)
        self.goals = torch.tensor([m.goal for m in mazes], device=device)
        self.enc = encoder
        self.layout = layout
        self.deltas = torch.tensor(ACTION_DELTAS, device=device)

    @torch.no_grad()
    def run(self, fast: FastTurnForward, max_steps: int = MAX_STEPS) -> dict:
        dev = self.walls.device
        n = len(self.walls)
        pos = self.starts.clone()
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        success = torch.zeros(n, dtype=torch.bool, device=dev)
        feedback = torch.zeros(n, dtype=torch.long, device=dev)
        steps = torch.zeros(n, dtype=torch.long, device=dev)
        reached = torch.zeros(n, dtype=torch.bool, device=dev)
        full_valid = total = 0
        was_training = fast.model.training
        fast.model.eval()
        act_ids = self.layout.action_token_ids
        every = torch.arange(n, device=dev)
        for t in range(max_steps):
            if bool(done.all()):
                break
            # all n frames every turn (fixed shapes, for compiled models); finished episodes are ignored
            pv, _ = self.enc.encode(self.walls, pos, self.goals)
            variants = torch.zeros_like(every) if t == 0 else 1 + (t - 1) * 2 + feedback
            ids, pred = self.layout.batch(variants)
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits_all = fast(ids, pv, pred[:, None])[:, 0].float()
            idx = torch.nonzero(~done)[:, 0]
            logits = logits_all[idx]
            a = logits[:, act_ids].argmax(-1)
            full_valid += int(torch.isin(logits.argmax(-1), act_ids).sum())
            total += idx.numel()
            steps[idx] += 1
            stop = a == STOP
            p = pos[idx]
            on_goal = (p == self.goals[idx]).all(1)
            success[idx[stop]] = on_goal[stop]
            done[idx[stop]] = True
            new = p + self.deltas[a]
            blocked = self.walls[idx, new[:, 0], new[:, 1]]
            moved = ~stop & ~blocked
            pos[idx] = torch.where(moved[:, None], new, p)
            feedback[idx] = (~stop & blocked).long()
            reached[idx] |= (pos[idx] == self.goals[idx]).all(1)
        fast.model.train(was_training)
        k = int(success.sum())
        return {
            "success": k,
            "n": n,
            "rate": k / n,
            "wilson95": wilson(k, n),
            "reached_goal": int(reached.sum()),
            "full_vocab_argmax_valid": full_valid / max(total, 1),
            "mean_steps": float(steps.float().mean()),
        }


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (round(centre - half, 4), round(centre + half, 4))


# ----------------------------------------------------------------------------------------------
# training


class Trainer:
    def __init__(self, model, processor, layout, encoder, pool, args, device, compile_model=False):
        self.model, self.processor, self.layout, self.enc, self.pool = model, processor, layout, encoder, pool
        self.args, self.device = args, device
        freeze_vision_pos_embed(model)
        pv, thw = encoder.encode(pool.walls[:1], pool.starts[:1], pool.goals[:1])
        self.fast = FastTurnForward(model, layout, pv.float(), thw)
        if compile_model:
            import torch._dynamo as dynamo

            dynamo.config.automatic_dynamic_shapes = False  # one static graph per batch size (train, eval)
            dynamo.config.cache_size_limit = 16
            text = model.model.language_model
            for layer in text.layers:
                layer.compile()
            text.norm.compile()
            text.rotary_emb.compile()
            self.fast.vision = torch.compile(self.fast.vision)
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=device.type == "cuda"
        )
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(args.seed)
        self.step_count = 0
        self.samples = 0
        self.fixed_pos = layout.position_ids  # (3, 1, L)

    def make_batch(self, b: int, max_goal_dist=None):
        a = self.args
        walls, agents, goals, target = self.pool.sample(b, a.onpath_frac, self.gen, max_goal_dist)
        k = torch.randint(0, MAX_STEPS, (b,), device=self.device, generator=self.gen)
        wall_fb = (torch.rand(b, device=self.device, generator=self.gen) < a.wall_feedback_frac).long()
        variants = torch.where(k == 0, torch.zeros_like(k), 1 + (k - 1) * 2 + wall_fb)
        ids, pred = self.layout.batch(variants, target)
        pv, thw = self.enc.encode(walls, agents, goals)
        select = torch.stack([pred, pred + 1], dim=1)
        targets = torch.stack([self.layout.action_token_ids[target], torch.full_like(target, self.layout.eos_id)], 1)
        return ids, pv, thw, select, targets

    def logits(self, mode, ids, pv, thw, select):
        if mode == "fast":
            return self.fast(ids, pv, select)
        # transformers' own path: model.model(...) computes M-RoPE ids (unless given) and runs vision per image
        import inspect

        kw = {}
        sig = inspect.signature(self.model.model.forward).parameters
        if "mm_token_type_ids" in sig:
            kw["mm_token_type_ids"] = (ids == self.layout.image_token_id).int()
        if mode == "hf_pos":
            kw["position_ids"] = self.fixed_pos[:, :, : ids.shape[1]].expand(3, ids.shape[0], ids.shape[1])
        out = self.model.model(input_ids=ids, pixel_values=pv, image_grid_thw=thw, use_cache=False, **kw)
        hidden = out.last_hidden_state
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
        return self.model.lm_head(hidden[rows, select])

    def lr_at(self, step):
        a = self.args
        return a.lr * min(1.0, (step + 1) / a.warmup_steps)

    def train_step(self, batch, mode="fast"):
        ids, pv, thw, select, targets = batch
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step_count)
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.logits(mode, ids, pv, thw, select)
        logits = logits.float()
        loss_tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none").view(targets.shape)
        loss = loss_tok.mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        self.opt.step()
        self.step_count += 1
        self.samples += ids.shape[0]
        acc = (logits[:, 0].argmax(-1) == targets[:, 0]).float().mean()
        return loss.detach(), loss_tok[:, 0].mean().detach(), acc.detach(), gnorm.detach()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_bench(trainer: Trainer, args, device) -> list[dict]:
    rows = []
    for b in [int(x) for x in args.bench_batches.split(",")]:
        # data path alone
        sync(device)
        t = time.time()
        for _ in range(5):
            batch = trainer.make_batch(b)
        sync(device)
        data_ms = (time.time() - t) / 5 * 1000
        for mode in args.bench_modes.split(","):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = []
            try:
                for i in range(1 + args.bench_steps):
                    batch = trainer.make_batch(b)
                    sync(device)
                    t = time.time()
                    trainer.train_step(batch, mode)
                    sync(device)
                    times.append(time.time() - t)
                    if times[-1] > 6 and i >= 1:
                        break
            except torch.OutOfMemoryError:
                log(f"bench b={b} {mode}: out of memory")
                torch.cuda.empty_cache()
                continue
            step_s = float(np.median(times[1:])) if len(times) > 1 else times[0]
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            row = {"batch": b, "mode": mode, "step_ms": round(step_s * 1000, 1), "samples_per_s": round(b / step_s),
                   "data_ms": round(data_ms, 1), "peak_gib": round(peak, 1), "timed_steps": len(times) - 1}
            rows.append(row)
            log("bench", json.dumps(row))
    for b in [int(x) for x in args.bench_fast_batches.split(",") if x]:
        times = []
        try:
            for i in range(1 + args.bench_steps):
                batch = trainer.make_batch(b)
                sync(device)
                t = time.time()
                trainer.train_step(batch, "fast")
                sync(device)
                times.append(time.time() - t)
        except torch.OutOfMemoryError:
            log(f"bench b={b} fast: out of memory")
            torch.cuda.empty_cache()
            continue
        step_s = float(np.median(times[1:]))
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        row = {"batch": b, "mode": "fast", "step_ms": round(step_s * 1000, 1), "samples_per_s": round(b / step_s),
               "peak_gib": round(peak, 1), "timed_steps": len(times) - 1}
        rows.append(row)
        log("bench", json.dumps(row))
    # where the time of a fast step goes (vision vs text), forward+backward, at the largest batch
    b = max(int(x) for x in args.bench_batches.split(","))
    if device.type == "cuda" and "fast" in args.bench_modes:
        from torch.profiler import ProfilerActivity, profile

        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    batch = trainer.make_batch(b)
                    trainer.train_step(batch, "fast")
                sync(device)
            log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
        except Exception as exc:  # the profile is a diagnostic only
            log(f"profiler failed: {exc!r}")
    return rows


def save_checkpoint(model, processor, out: Path, name: str, evaluator, layout, encoder, part_mib: int = 15) -> dict:
    """bf16 copy -> save_pretrained + processor -> tar split in parts; returns the bf16 copy's eval."""
    import copy

    m16 = type(model)(model.config).to(device=model.device, dtype=torch.bfloat16)
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    m16.generation_config = copy.deepcopy(model.generation_config)
    m16.eval()
    pv, thw = encoder.encode(evaluator.walls[:1], evaluator.starts[:1], evaluator.goals[:1])
    res = evaluator.run(FastTurnForward(m16, layout, pv.to(torch.bfloat16), thw))
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / name
        m16.save_pretrained(d, max_shard_size="200MB")
        processor.save_pretrained(d)
        (d / "rlexp_sft_pixels.json").write_text(json.dumps({"eval_bf16_pinned64": res}, indent=1) + "\n")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            tf.add(d, arcname=name)
        data = buf.getvalue()
    part = part_mib * 2**20
    for i in range(0, len(data), part):
        (out / f"{name}.tar.{i // part:02d}").write_bytes(data[i : i + part])
    del m16
    log(f"saved {name}: {len(data) / 2**20:.1f} MiB tar, bf16 eval {res['success']}/64")
    return res


def check_rollout(path: str, out: Path, device: str = "cpu") -> dict:
    """Evaluate a saved checkpoint with the project's own rollout (``run_rollouts`` + ``HFEngine``, the
    tokens ``TurnFormatter`` builds, replies generated over the full vocabulary and parsed as text) on
    the pinned 64 at <= 20 turns, env cell_px=32, history_window=1. Needs the full package (gymnasium)."""
    from types import SimpleNamespace

    from transformers import AutoProcessor

    from rlexp.evaluation.evaluate import evaluate_model
    from rlexp.rollout.conversation import TurnFormatter
    from rlexp.rollout.hf_engine import HFEngine

    processor = AutoProcessor.from_pretrained(path)
    model = load_model(path, torch.device(device)).eval()
    env_cfg = SimpleNamespace(size=SIZE, max_steps=MAX_STEPS, cell_px=CELL_PX, history_window=1, action_format="visgym_tuple",
                              prompt="visgym", terminate_on_goal=False, format_reward=0.0)
    rollout_cfg = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens_per_turn=4, max_turns=MAX_STEPS)
    eval_cfg = SimpleNamespace(greedy=True, samples_per_maze=1)
    t = time.time()
    result, _ = evaluate_model(HFEngine(model, processor), TurnFormatter(processor), load_pinned("maze_easy"), env_cfg,
                               rollout_cfg, eval_cfg)
    log(f"check-rollout {path}: {result.summary()} ({time.time() - t:.0f} s on {device})")
    result.write(out / f"rollout_eval_{Path(path).name}.jsonl")
    return {"success": round(result.success_rate * 64), "summary": result.summary()}


def main(argv=None):
    global LOG
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # model
    p.add_argument("--text-hidden", type=int, default=256)
    p.add_argument("--text-layers", type=int, default=8)
    p.add_argument("--text-heads", type=int, default=4)
    p.add_argument("--text-kv-heads", type=int, default=2)
    p.add_argument("--text-inter", type=int, default=768)
    p.add_argument("--vis-hidden", type=int, default=128)
    p.add_argument("--vis-depth", type=int, default=1)
    p.add_argument("--vis-heads", type=int, default=4)
    p.add_argument("--vis-inter", type=int, default=256)
    p.add_argument("--init-from", default=None, help="a saved checkpoint dir to continue from (weights only)")
    # data
    p.add_argument("--pool", type=int, default=300_000)
    p.add_argument("--pool-file", default=None)
    p.add_argument("--stream-seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--onpath-frac", type=float, default=0.5)
    p.add_argument("--wall-feedback-frac", type=float, default=0.2)
    p.add_argument("--curriculum-s", type=float, default=0.0, help="grow the max goal distance from 1 to all over this many seconds")
    # optimisation
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--time-budget-s", type=float, default=300)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every-s", type=float, default=10)
    p.add_argument("--eval-fine-s", type=float, default=3, help="eval interval once success >= 20%%")
    p.add_argument("--warm-range", default="0.40,0.50")
    p.add_argument("--stop-at", type=float, default=1.01, help="end training once eval success >= this")
    p.add_argument("--no-final-save", action="store_true")
    # bench
    p.add_argument("--compile", action="store_true", help="torch.compile the text layers and the vision path")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--bench-only", action="store_true")
    p.add_argument("--bench-batches", default="256,1024")
    p.add_argument("--bench-modes", default="hf,hf_pos,fast")
    p.add_argument("--bench-steps", type=int, default=3)
    p.add_argument("--bench-fast-batches", default="2048", help="batch sizes timed on the fast path only")
    p.add_argument("--samples-offset", type=int, default=0, help="samples already seen (a continued run), for the curve")
    p.add_argument("--time-offset", type=float, default=0.0, help="training seconds already spent (a continued run)")
    p.add_argument("--check-rollout", default=None, help="only evaluate this checkpoint dir with the project's rollout (CPU)")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    LOG = open(out / "log.txt", "a")
    if args.check_rollout:
        check_rollout(args.check_rollout, out, "cpu")
        return
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    import transformers

    log(f"# sft_pixels {time.strftime('%Y-%m-%d %H:%M:%S')} torch {torch.__version__} transformers {transformers.__version__} "
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    log("args", json.dumps(vars(args)))

    from transformers import AutoProcessor

    from rlexp.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        processor = AutoProcessor.from_pretrained(build_tiny_model(Path(tmp) / "tiny"))
    layout = TurnLayout.build(processor, SIZE, CELL_PX, MAX_STEPS).to(device)
    encoder = FrameEncoder.from_processor(processor, SIZE, CELL_PX, device=device,
                                          dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    log(f"layout: {layout.num_variants} turn variants, length {int(layout.lengths.min())}-{int(layout.lengths.max())} tokens, "
        f"image at {layout.image_offset} ({layout.image_tokens} tokens), pixel_values/img {encoder.patches_per_image}x{encoder.patch_dim}")

    walls, starts, goals = load_or_build_pool(args.pool_file, args.pool, args.stream_seed, args.workers)
    t = time.time()
    pool = Pool(walls, starts, goals, device)
    sync(device)
    log(f"pool on device with BFS tables in {time.time() - t:.2f} s; mean expert path {pool.path_len.float().mean():.2f} moves; "
        f"distinct grids {len(np.unique(np.packbits(walls.reshape(len(walls), -1), axis=1), axis=0))}")

    def fresh_model():
        if args.init_from:
            return load_model(args.init_from, device)
        return make_model(processor, args, device)

    model = fresh_model()
    tot, vis = count_params(model)
    log(f"model: {tot / 1e6:.2f} M params ({vis / 1e6:.2f} M vision), attn {model.config._attn_implementation}")
    evaluator = PinnedEval(encoder, layout, device)
    trainer = Trainer(model, processor, layout, encoder, pool, args, device)

    # the fast path agrees with transformers on this machine and version (fp32, 4 samples)
    with torch.no_grad():
        batch = trainer.make_batch(4)
        ids, pv, thw, select, _ = batch
        a = trainer.logits("fast", ids, pv.float(), thw, select)
        b = trainer.logits("hf", ids, pv.float(), thw, select)
        log(f"check: fast vs transformers max |logit diff| (fp32) = {(a - b).abs().max().item():.2e}")

    summary = {"args": vars(args), "params_M": tot / 1e6}
    if args.bench or args.bench_only:
        summary["bench"] = run_bench(trainer, args, device)
        (out / "metrics.json").write_text(json.dumps(summary, indent=1))
        if args.bench_only:
            return
        model = fresh_model()  # start the learning run from the same initial weights
        trainer = Trainer(model, processor, layout, encoder, pool, args, device)
    if args.compile:
        model = fresh_model()
        trainer = Trainer(model, processor, layout, encoder, pool, args, device, compile_model=True)
        tc = time.time()
        try:
            r = evaluator.run(trainer.fast)
            sync(device)
            log(f"compile: eval shapes compiled in {time.time() - tc:.1f} s (eval {r['success']}/64)")
        except Exception as exc:
            log(f"compile failed ({exc!r:.300}); continuing without it")
            args.compile = False
            torch._dynamo.reset()
            model = fresh_model()
            trainer = Trainer(model, processor, layout, encoder, pool, args, device)

    lo, hi = (float(x) for x in args.warm_range.split(","))
    curve = []
    summary["curve"] = curve
    warm_saved = False
    r0 = evaluator.run(trainer.fast)
    curve.append({"t": 0.0, "samples": 0, "step": 0, **r0})
    log(f"eval t=0 samples=0 success {r0['success']}/64 valid {r0['full_vocab_argmax_valid']:.2f}")
    t0 = time.time()
    train_time = 0.0
    last_eval = 0.0
    acc_hist = []
    while True:
        el = time.time() - t0
        if el > args.time_budget_s or (args.max_steps and trainer.step_count >= args.max_steps):
            break
        max_d = None
        if args.curriculum_s > 0 and train_time < args.curriculum_s:
            max_d = 1 + int(30 * train_time / args.curriculum_s)
        ts = time.time()
        batch = trainer.make_batch(args.batch, max_d)
        if trainer.step_count == 0 and args.compile:
            try:
                loss, aloss, acc, gnorm = trainer.train_step(batch)
            except Exception as exc:
                log(f"compiled train step failed ({exc!r:.300}); continuing without compile")
                args.compile = False
                torch._dynamo.reset()
                model = fresh_model()
                trainer = Trainer(model, processor, layout, encoder, pool, args, device)
                loss, aloss, acc, gnorm = trainer.train_step(batch)
        else:
            loss, aloss, acc, gnorm = trainer.train_step(batch)
        if trainer.step_count % args.log_every == 0 or trainer.step_count == 1:
            sync(device)
        if trainer.step_count == 1:
            log(f"first train step {time.time() - ts:.1f} s (includes compilation with --compile)")
            if args.compile:
                ts = time.time()  # report steady-state samples/s: compile time is left out of train time
        train_time += time.time() - ts
        acc_hist.append(acc)
        if trainer.step_count % args.log_every == 0:
            accm = torch.stack(acc_hist).mean().item()
            acc_hist = []
            log(f"step {trainer.step_count} samples {trainer.samples} t {train_time:.1f}s {trainer.samples / train_time:.0f} samples/s "
                f"loss {loss.item():.4f} action_loss {aloss.item():.4f} acc {accm:.3f} gnorm {gnorm.item():.2f}"
                + (f" max_goal_dist {max_d}" if max_d else ""))
        good = curve[-1]["rate"] >= 0.2
        if train_time - last_eval >= (args.eval_fine_s if good else args.eval_every_s):
            last_eval = train_time
            te = time.time()
            r = evaluator.run(trainer.fast)
            curve.append({"t": round(train_time, 1), "samples": trainer.samples, "step": trainer.step_count,
                          "t_total": round(train_time + args.time_offset, 1), "samples_total": trainer.samples + args.samples_offset, **r})
            log(f"eval t={train_time:.1f}s samples={trainer.samples} success {r['success']}/64 {r['wilson95']} reached {r['reached_goal']} "
                f"valid {r['full_vocab_argmax_valid']:.3f} steps {r['mean_steps']:.1f} ({time.time() - te:.2f} s)")
            if not warm_saved and lo <= r["rate"] <= hi:
                r16 = save_checkpoint(model, processor, out, "sft_warm", evaluator, layout, encoder)
                if lo <= r16["rate"] <= hi:
                    warm_saved = True
                    summary["warm"] = {"t": round(train_time, 1), "samples": trainer.samples, "step": trainer.step_count,
                                       "eval_fp32_autocast": r, "eval_bf16_saved": r16}
                else:
                    log("bf16 copy left the warm range; keep looking")
                    for f in out.glob("sft_warm.tar.*"):
                        f.unlink()
            (out / "metrics.json").write_text(json.dumps(summary, indent=1))
            if r["rate"] >= args.stop_at:
                break
    r = evaluator.run(trainer.fast)
    curve.append({"t": round(train_time, 1), "samples": trainer.samples, "step": trainer.step_count,
                          "t_total": round(train_time + args.time_offset, 1), "samples_total": trainer.samples + args.samples_offset, **r})
    log(f"final: steps {trainer.step_count} samples {trainer.samples} train time {train_time:.1f}s "
        f"({trainer.samples / max(train_time, 1e-9):.0f} samples/s incl. evals excluded) success {r['success']}/64 {r['wilson95']}")
    if not args.no_final_save:
        summary["final"] = {"t": round(train_time, 1), "samples": trainer.samples, "step": trainer.step_count, "eval": r,
                            "eval_bf16_saved": save_checkpoint(model, processor, out, "sft_final", evaluator, layout, encoder)}
    (out / "metrics.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
