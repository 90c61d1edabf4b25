"""Training throughput: a Lightning ``fit`` against a hand-written PyTorch loop.

Same model (VisionClassifier's network), same data loader over the bundled synthetic faces, same
optimizer and batch size, measured side by side in one run (alternating, after a warm-up).
Writes ``bench/results/train_throughput.json``. Target: Lightning / hand loop >= 0.9.

    python bench/train_throughput.py [--batches 30] [--repeats 3] [--backbone mobilenet_v2]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import lightning as L
import torch

from fairprune.data.faces import FaceDataModule
from fairprune.models.vision import VisionClassifier


class _Timer(L.Callback):
    """Wall time of the training batches, from the first batch's start to the last batch's end."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.start


def build(args):
    dm = FaceDataModule(dataset="synthetic", target="gender", sensitive="race", image_size=args.image_size,
                        batch_size=args.batch_size, synthetic_size=args.synthetic_size)
    dm.prepare_data()
    dm.setup("fit")
    torch.manual_seed(0)
    model = VisionClassifier(backbone=args.backbone, class_names=dm.class_names, group_names=dm.group_names,
                             backbone_kwargs=args.backbone_kwargs)
    return dm, model


def hand_loop(dm, model, batches: int) -> float:
    loader = dm.train_dataloader()
    optimizer = model.configure_optimizers()
    model.train()
    start = time.perf_counter()
    for i, (x, y, _) in enumerate(loader):
        if i == batches:
            break
        loss = model.loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start


def lightning_fit(dm, model, batches: int) -> float:
    timer = _Timer()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=batches, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer], accelerator="cpu", devices=1)
    trainer.fit(model, datamodule=dm)
    return timer.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="mobilenet_v2")
    parser.add_argument("--width-mult", type=float, default=0.5)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--synthetic-size", type=int, default=4000)
    parser.add_argument("--out", default="bench/results/train_throughput.json")
    args = parser.parse_args()
    args.backbone_kwargs = {"width_mult": args.width_mult} if args.backbone == "mobilenet_v2" else {}
    dm, model = build(args)
    images = args.batches * args.batch_size
    print("warm-up ...", flush=True)
    hand_loop(dm, model, 3)
    rows = []
    for r in range(args.repeats):
        hand = hand_loop(dm, model, args.batches)
        light = lightning_fit(dm, model, args.batches)
        rows.append({"hand_img_s": images / hand, "lightning_img_s": images / light})
        print(f"repeat {r + 1}/{args.repeats}: hand {images / hand:.1f} img/s, lightning {images / light:.1f} img/s", flush=True)
    hand_best = max(r["hand_img_s"] for r in rows)
    light_best = max(r["lightning_img_s"] for r in rows)
    result = {
        "benchmark": "train_throughput", "backbone": args.backbone, "backbone_kwargs": args.backbone_kwargs,
        "batch_size": args.batch_size, "image_size": args.image_size, "batches_per_repeat": args.batches,
        "repeats": rows, "hand_img_s_best": hand_best, "lightning_img_s_best": light_best,
        "ratio_lightning_over_hand": light_best / hand_best, "target": ">= 0.9",
        "torch_threads": torch.get_num_threads(), "machine": platform.machine(), "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"ratio lightning/hand = {result['ratio_lightning_over_hand']:.3f} (best of {args.repeats}); written to {args.out}")


if __name__ == "__main__":
    main()
