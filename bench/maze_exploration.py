"""How much can GRPO's sampling find from a maze checkpoint? Per-maze solve rates at several temperatures.

GRPO learns only from groups whose samples differ in reward: a maze that all 8 samples solve, or that none
does, gives no gradient. This bench plays each maze ``--samples`` times at each ``--temperatures`` from a
checkpoint (one image a turn, 32 px cells, <= 20 steps, sampling over the 5 action tokens), and prints

* the mean true success at that temperature (and greedy);
* the share of groups of ``--group`` samples with a non-zero advantage, ``E[1 - p^G - (1 - p)^G]`` over
  the mazes' solve rates ``p``; and how many mazes no sample solved;
* for each maze the greedy policy fails: the first state where its move differs from the BFS expert's, and
  the probability it gives the expert's move there (what a sample needs to hit to leave the loop).

Runs on the pinned 64 and on fresh training mazes (the project's generator, training-stream seeds).

    PYTHONPATH=. python3 bench/maze_exploration.py --checkpoint checkpoints/maze_sft_warm_seed0 \
        [--samples 64] [--temperatures 1.0,1.5,2.0] [--train-mazes 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sft_pixels as sp  # noqa: E402  (the SFT bench: pool, BFS tables, fast forward, pinned eval)


@torch.no_grad()
def play(fast, layout, encoder, pool, maze_idx, temperature: float, gen: torch.Generator, max_steps=sp.MAX_STEPS):
    """Closed-loop episodes on ``pool`` mazes ``maze_idx`` (one per row); ``temperature`` 0 is greedy.
    Returns success (B,) and, per row, (first turn the move differs from the expert's, p(expert) there)."""
    dev = pool.walls.device
    walls, goals = pool.walls[maze_idx], pool.goals[maze_idx]
    n = len(maze_idx)
    pos = pool.starts[maze_idx].clone()
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    success = torch.zeros(n, dtype=torch.bool, device=dev)
    feedback = torch.zeros(n, dtype=torch.long, device=dev)
    first_dev = torch.full((n,), -1, dtype=torch.long, device=dev)
    p_expert_there = torch.full((n,), float("nan"), device=dev)
    deltas = torch.tensor(sp.ACTION_DELTAS, device=dev)
    rows = torch.arange(n, device=dev)
    for t in range(max_steps):
        if bool(done.all()):
            break
        pv, _ = encoder.encode(walls, pos, goals)
        variants = torch.zeros_like(rows) if t == 0 else 1 + (t - 1) * 2 + feedback
        ids, pred = layout.batch(variants)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = fast(ids, pv, pred[:, None])[:, 0].float()[:, layout.action_token_ids]
        probs = torch.softmax(logits, -1)
        if temperature == 0:
            a = logits.argmax(-1)
        else:
            a = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
        expert = pool.next_move[maze_idx, pos[:, 0], pos[:, 1]]
        newly = ~done & (first_dev < 0) & (a != expert)
        first_dev = torch.where(newly, torch.full_like(first_dev, t), first_dev)
        p_expert_there = torch.where(newly, probs[rows, expert], p_expert_there)
        stop = ~done & (a == sp.STOP)
        success |= stop & (pos == goals).all(1)
        new = pos + deltas[a.clamp(max=3)]
        blocked = walls[rows, new[:, 0].clamp(0, walls.shape[1] - 1), new[:, 1].clamp(0, walls.shape[2] - 1)]
        moved = ~done & ~stop & ~blocked
        pos = torch.where(moved[:, None], new, pos)
        feedback = (~stop & blocked).long()
        done |= stop
    return success, first_dev, p_expert_there


def survey(name, fast, layout, encoder, pool, args, gen) -> dict:
    n = pool.n
    greedy, first_dev, p_exp = play(fast, layout, encoder, pool, torch.arange(n, device=pool.walls.device), 0.0, gen)
    fails = (~greedy).nonzero()[:, 0].tolist()
    out = {"set": name, "mazes": n, "greedy_success": int(greedy.sum()), "greedy_fail_first_deviation": []}
    for i in fails:
        out["greedy_fail_first_deviation"].append(
            {"maze": i, "path_len": int(pool.path_len[i]), "turn": int(first_dev[i]), "p_expert": round(float(p_exp[i]), 4)}
        )
    pe = [r["p_expert"] for r in out["greedy_fail_first_deviation"]]
    print(f"[{name}] greedy {int(greedy.sum())}/{n}; at the first wrong move of the {len(fails)} failures, "
          f"p(expert move) median {np.median(pe) if pe else float('nan'):.3f}, "
          f"< 0.05 for {sum(p < 0.05 for p in pe)}, < 0.2 for {sum(p < 0.2 for p in pe)}")
    by_len = {}
    for i in range(n):
        k = int(pool.path_len[i])
        by_len.setdefault(k, [0, 0])
        by_len[k][0] += 1
        by_len[k][1] += int(greedy[i])
    print(f"[{name}] greedy by expert path length: " + ", ".join(f"{k}: {s}/{m}" for k, (m, s) in sorted(by_len.items())))
    out["greedy_by_path_len"] = {str(k): v for k, v in sorted(by_len.items())}
    out["sampled"] = []
    for temp in args.temperatures:
        idx = torch.arange(n, device=pool.walls.device).repeat_interleave(args.samples)
        rates = []
        for chunk in idx.split(args.chunk):
            s, _, _ = play(fast, layout, encoder, pool, chunk, temp, gen)
            rates.append(s.float())
        p = torch.cat(rates).view(n, args.samples).mean(1).cpu().numpy()
        g = args.group
        signal = float(np.mean(1 - p**g - (1 - p) ** g))
        row = {"temperature": temp, "success": float(p.mean()), "groups_with_signal": signal,
               "never_solved": int((p == 0).sum()), "always_solved": int((p == 1).sum()),
               "solve_rate_per_maze": [round(float(x), 4) for x in p]}
        out["sampled"].append(row)
        print(f"[{name}] T={temp}: success {p.mean():.3f}; groups of {g} with a non-zero advantage {signal:.3f}; "
              f"never solved {row['never_solved']}/{n}, always {row['always_solved']}/{n}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--samples", type=int, default=64, help="episodes a maze at each temperature")
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 1.5, 2.0])
    ap.add_argument("--group", type=int, default=8, help="GRPO group size the signal share is computed for")
    ap.add_argument("--train-mazes", type=int, default=256, help="fresh training mazes surveyed too (0: none)")
    ap.add_argument("--chunk", type=int, default=2048, help="episodes a forward batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)

    from transformers import AutoProcessor

    from rlexp.envs.pinned import load_pinned
    from rlexp.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        processor = AutoProcessor.from_pretrained(build_tiny_model(Path(tmp) / "tiny"))
    layout = sp.TurnLayout.build(processor, sp.SIZE, sp.CELL_PX, sp.MAX_STEPS).to(device)
    encoder = sp.FrameEncoder.from_processor(processor, sp.SIZE, sp.CELL_PX, device=device,
                                             dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = sp.load_model(args.checkpoint, device).eval()
    sp.freeze_vision_pos_embed(model)
    gen = torch.Generator(device=device).manual_seed(args.seed)

    mazes = load_pinned("maze_easy")
    pinned = sp.Pool(np.stack([m.grid for m in mazes]), np.array([m.start for m in mazes]),
                     np.array([m.goal for m in mazes]), device)
    pv, thw = encoder.encode(pinned.walls[:1], pinned.starts[:1], pinned.goals[:1])
    fast = sp.FastTurnForward(model, layout, pv.float(), thw)
    results = {"checkpoint": args.checkpoint, "samples": args.samples, "group": args.group,
               "sets": [survey("pinned64", fast, layout, encoder, pinned, args, gen)]}
    if args.train_mazes:
        walls, starts, goals = sp.build_pool(args.train_mazes, stream_seed=args.seed, workers=1)
        train = sp.Pool(walls, starts, goals, device)
        results["sets"].append(survey(f"train{args.train_mazes}", fast, layout, encoder, train, args, gen))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
