import traceback, torch
import vexact_kernels as vk
from contracts.test_batch_invariance import _paged_run, _rand
for d, heads in ((16, (4, 2)), (64, (4, 2))):
    try:
        lens, page = [1, 5], 1
        hq, hkv = heads
        total = sum(lens)
        g = torch.Generator().manual_seed(0)
        q, k, v = (_rand(g, total, h, d).to("cuda") for h in (hq, hkv, hkv))
        cu = torch.tensor([0, 1, 6], device="cuda")
        packed = vk.attention_packed(q, k, v, cu)
        paged = _paged_run(q, k, v, lens, [[1], [2, 3]], page, total, hkv, d)
        print(d, "equal:", torch.equal(packed, paged))
    except Exception:
        traceback.print_exc(limit=-4)
