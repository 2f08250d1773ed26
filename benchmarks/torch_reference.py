"""The PyTorch reference SimCSE train step the speed benchmarks compare against.

`transformers.BertModel` + the SimCSE loss (cosine / temperature InfoNCE with in-batch
negatives; supervised: entailment positives and contradiction negatives) + global-norm clipping
+ `torch.optim.AdamW` with a linear decay, as the reference implementation trains. Imports no
JAX, so run as a script it measures PyTorch's own peak memory (holding the tokenizer, as a
training script does and as jaxsim's measured train step does):

    python benchmarks/torch_reference.py --arrays unsup.npz (--model PATH | --shape tiny)
        [--tokenizer FOLDER] [--autocast bfloat16] [--threads 2]
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
from common import SHAPES, print_peak_memory, status_mb

LR, TOTAL_STEPS, TEMP, CLIP, DROPOUT = 3e-5, 1000, 0.05, 1.0, 0.1


def load_model(model_path: str | None = None, config: Mapping | None = None):
    """A BertModel from a folder (pretrained) or from config values (random init), train mode,
    dropout 0.1, no pooler layer."""
    from transformers import BertConfig, BertModel
    from transformers.utils import logging as hf_logging

    dropout = {"hidden_dropout_prob": DROPOUT, "attention_probs_dropout_prob": DROPOUT}
    if model_path is not None:
        # The checkpoint's pooler weights go unused on purpose (no pooler layer): without this,
        # transformers prints a load report calling them UNEXPECTED (and a progress bar).
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        model = BertModel.from_pretrained(model_path, add_pooling_layer=False, **dropout)
    else:
        model = BertModel(BertConfig(**{**dict(config), **dropout}), add_pooling_layer=False)
    return model.train()


def make_step(model, arrays: Mapping[str, np.ndarray], unsup: bool, device: str = "cpu",
              autocast_dtype=None) -> Callable[[], None]:
    """A no-argument callable running one train step (synchronized on accelerators).

    Args:
      model: a `transformers.BertModel` in train mode.
      arrays: int [batch, views, len] 'input_ids', 'attention_mask', 'token_type_ids'.
      unsup: each sentence is encoded twice (two dropout views, adjacent rows), else the
        views are (premise, entailment, contradiction).
      device: 'cpu' or 'cuda'.
      autocast_dtype: e.g. torch.bfloat16 for mixed precision (float32 master weights).
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / TOTAL_STEPS))
    b, views, length = arrays["input_ids"].shape
    rep = 2 if unsup else 1
    ids, mask, types = (torch.from_numpy(np.asarray(arrays[k]).reshape(b * views, length))
                        .long().repeat_interleave(rep, 0).to(device)
                        for k in ("input_ids", "attention_mask", "token_type_ids"))
    target = torch.arange(b, device=device)

    def cos(x, y):
        return F.cosine_similarity(x.unsqueeze(1), y.unsqueeze(0), dim=-1)

    def run():
        with torch.autocast(device_type=device, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
        hidden = out.last_hidden_state.float()
        m = mask.unsqueeze(-1).float()
        z = ((hidden * m).sum(1) / m.sum(1)).view(b, -1, hidden.shape[-1])  # [B, V, H]
        logits = cos(z[:, 0], z[:, 1]) / TEMP
        if not unsup:
            logits = torch.cat([logits, cos(z[:, 0], z[:, 2]) / TEMP], dim=1)
        F.cross_entropy(logits, target).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()

    return run



def main():
    parser = argparse.ArgumentParser(description="peak memory of the PyTorch reference step")
    parser.add_argument("--arrays", type=Path, required=True, help=".npz of [B, V, L] arrays")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model folder")
    source.add_argument("--shape", choices=sorted(SHAPES), help="random init at this shape")
    parser.add_argument("--autocast", default="float32", choices=("float32", "bfloat16"),
                        help="bfloat16: the step under torch.autocast (float32 master weights)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder (default: the --model folder; none with --shape)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    import torch
    import transformers  # noqa: F401  (counted in the baseline, as on the jaxsim side)

    torch.set_num_threads(args.threads)
    arrays = dict(np.load(args.arrays))
    baseline = status_mb("VmRSS")
    model = (load_model(args.model) if args.model else load_model(config=SHAPES[args.shape]))
    tokenizer = None  # held while the steps run, as a training script holds it
    if args.tokenizer or args.model:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    run = make_step(model, arrays, unsup=arrays["input_ids"].shape[1] == 1,
                    autocast_dtype=torch.bfloat16 if args.autocast == "bfloat16" else None)
    print_peak_memory(run, args.steps, baseline)
    del tokenizer


if __name__ == "__main__":
    main()
