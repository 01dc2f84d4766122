"""The gated delta rule (Gated DeltaNet's recurrence), chunked for prefill and recurrent for decode.

Per head, with state S [Dk, Dv]: S ← exp(g_t)·S; S ← S + k_t ⊗ β_t (v_t − Sᵀk_t); o_t = Sᵀq_t, where q and
k are L2-normalised and q is scaled by Dk^-1/2. The chunked form processes `chunk` tokens with matrix products
(a unit-lower-triangular solve replaces the token loop inside a chunk). On CUDA, fla-core's Triton kernels run
it when installed; these torch versions run everywhere and are the reference.
"""

from __future__ import annotations

import torch


def _normalise(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv] (fp32).

    Returns (o [B, H, Dv], new state).
    """
    q, k = _normalise(q.float(), k.float())
    state = state * g.float().exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)  # [B, H, Dv]
    delta = (v.float() - predicted) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded batch: q, k [B, L, H, Dk], v [B, L, H, Dv], g, beta [B, L, H], state [B, H, Dk, Dv].

    Right padding must carry g = 0 and beta = 0 (the state passes through unchanged). Returns
    (o [B, L, H, Dv] fp32, final state [B, H, Dk, Dv] fp32).
    """
    length = q.shape[1]
    q, k = _normalise(q.float(), k.float())
    q, k, v = (x.transpose(1, 2) for x in (q, k, v.float()))  # [B, H, L, D]
    g, beta = g.float().transpose(1, 2), beta.float().transpose(1, 2)  # [B, H, L]
    pad = (-length) % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    b, h, total, _ = k.shape
    q, k, v = (x.reshape(b, h, total // chunk, chunk, x.shape[-1]) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = (x.reshape(b, h, total // chunk, chunk) for x in (g, beta))

    cum = g.cumsum(-1)  # [B, H, N, C] log-decay from the chunk start
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [.., C, C]
    kb = k * beta[..., None]
    # (I + strictly-lower(β k kᵀ ⊙ decay)) is unit lower triangular: solve instead of looping over tokens.
    system = (kb @ k.transpose(-1, -2)) * decay
    system = system.tril(-1) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk, diagonal included
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    end_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    s = state.float()
    out = torch.empty_like(v)
    for n in range(total // chunk):
        v_new = u[:, :, n] - w[:, :, n] @ s  # [B, H, C, Dv]
        out[:, :, n] = q_decayed[:, :, n] @ s + intra[:, :, n] @ v_new
        s = s * end_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, total, -1)[:, :, :length].transpose(1, 2)  # [B, L, H, Dv]
    return out, s
