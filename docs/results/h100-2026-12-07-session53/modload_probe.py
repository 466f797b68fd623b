"""Probe: does loading a new Triton kernel (cuModuleLoad) fail when PyTorch's cache holds the card?"""
import torch
import triton
import triton.language as tl

DEV = torch.device("cuda", 0)


@triton.jit
def _add_one(x, n, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(x + o, tl.load(x + o, mask=o < n) + 1, mask=o < n)


def fill(small=1 << 19):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    primer = torch.empty(small, dtype=torch.uint8, device=DEV)
    free, _ = torch.cuda.mem_get_info()
    for margin in (2 << 20, 4 << 20, 8 << 20, 16 << 20):
        try:
            hog = torch.empty(free - margin, dtype=torch.uint8, device=DEV)
            break
        except torch.OutOfMemoryError:
            continue
    del hog, primer
    return torch.cuda.mem_get_info()[0]


x = torch.zeros(1 << 20, device=DEV)
_add_one[(8,)](x, x.numel(), B=128)
torch.cuda.synchronize()
torch.cuda.Stream()  # the stream pool, made before the fill
# Compile (not load) the next specializations first, so the probe isolates the module load:
for B in (256, 512, 1024, 2048):
    _add_one.warmup(x, x.numel(), B=B, grid=(1,))
print("free after fill:", fill())
for B in (256, 512, 1024, 2048):
    st = torch.cuda.memory_stats()
    try:
        _add_one[(8,)](x, x.numel(), B=B)
        torch.cuda.synchronize()
        print(B, "ok", "free", torch.cuda.mem_get_info()[0], "retries", st.get("num_alloc_retries"))
    except Exception as e:  # noqa: BLE001
        print(B, type(e).__name__, str(e)[:400].replace("\n", " "))
        break
print("x[0] =", float(x[0]))
