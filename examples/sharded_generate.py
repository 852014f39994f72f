"""Sharded generate(): every rank keeps only its share of each MoE block's routed experts, and all ranks produce the
same tokens (the router, shared experts and the rest of the model are whole on every rank).

    torchrun --nproc-per-node 2 examples/sharded_generate.py                      # GPUs: NCCL, one GPU a rank
    torchrun --nproc-per-node 2 examples/sharded_generate.py --cpu                # CPU: gloo
    torchrun --nproc-per-node 2 examples/sharded_generate.py --model PATH --mode tp --prompt "The capital of"

--mode ep: expert parallel (each rank E / W whole experts); tp: tensor parallel (each rank I / W intermediate columns
of every expert). Without --model, a tiny random-weight Qwen3-MoE built from its config (no download). The script
checks that every rank generated the same tokens and prints what rank 0 holds.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import moecomp


def tiny_model(dtype):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)  # the same weights on every rank
    return Qwen3MoeForCausalLM(cfg).to(dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a local checkpoint directory (default: a tiny random Qwen3-MoE)")
    ap.add_argument("--mode", choices=("ep", "tp"), default="ep")
    ap.add_argument("--prompt", default="Mixture of experts")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU even where there are GPUs")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.cpu
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        ids = AutoTokenizer.from_pretrained(args.model)(args.prompt, return_tensors="pt").input_ids
    else:
        model = tiny_model(dtype)
        ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    model = model.to(device).eval()
    ids = ids.to(device)

    moecomp.optimize(model)  # every MoE block -> one op call (verified on the whole weights)
    held = moecomp.shard_experts(model, None, args.mode)  # this rank keeps its shard; the rest is freed
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)

    every = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(every, out)
    same = all(torch.equal(o, out) for o in every)
    if rank == 0:
        first = next(iter(held.items()), ("(no MoE block)", ""))
        print(f"{world} ranks, mode {args.mode}: {len(held)} MoE blocks; rank 0 holds {first[0]}: {first[1]}")
        print(f"generated {out.shape[1] - ids.shape[1]} tokens, the same on every rank: {same}")
        print(out[0, ids.shape[1]:].tolist())
    dist.destroy_process_group()
    if not same:
        raise SystemExit("ranks generated different tokens")


if __name__ == "__main__":
    main()
