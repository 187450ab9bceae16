"""The lane bookkeeping of the tensor-core kernels (TwellBlockedUpMmaKernel and
TwellBlockedDownMmaKernel, ffi/twell_blocked.cuh; TwellDecodeGateKernel,
ffi/twell_decode.cu) against a NumPy model of the PTX warp instructions they use:
ldmatrix.m8n8.x4[.trans].b16 and mma.m16n8k16.row.col.f32 with the fragment layouts of
the PTX ISA. Runs on CPU; it checks the kernels' index formulas (which lane addresses
which row, where the diagonal lands, how A is built from (h, token) words, the shared
memory swizzle), not the hardware. The GPU tests check the kernels themselves."""

import numpy as np
import pytest

LANES = np.arange(32)


def ldmatrix_x4(rows_by_lane, trans=False):
    """rows_by_lane[l]: the 8 values at the address lane l gives (matrix l // 8, row l % 8).
    Returns regs[lane][i] = (lo, hi): the pair of matrix i that thread `lane` receives."""
    regs = np.zeros((32, 4, 2))
    for i in range(4):
        m = np.stack([rows_by_lane[8 * i + r] for r in range(8)])  # 8 x 8, row r from lane 8i + r
        if trans:
            m = m.T
        for lane in range(32):
            regs[lane, i] = m[lane // 4, 2 * (lane % 4) : 2 * (lane % 4) + 2]
    return regs


def mma_m16n8k16(a, b, c):
    """a[lane] = 4 pairs (A 16x16 row-major fragment), b[lane] = 2 pairs (B 16x8 fragment),
    c[lane] = 4 floats (C 16x8); returns D in the same layout as c."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col : col + 2] = a[lane, reg]
        for reg, k in enumerate([2 * t, 2 * t + 8]):
            B[k : k + 2, g] = b[lane, reg]
    C = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        C[g, 2 * t : 2 * t + 2] = c[lane, 0:2]
        C[g + 8, 2 * t : 2 * t + 2] = c[lane, 2:4]
    D = A @ B + C
    d = np.zeros((32, 4))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        d[lane, 0:2] = D[g, 2 * t : 2 * t + 2]
        d[lane, 2:4] = D[g + 8, 2 * t : 2 * t + 2]
    return d


@pytest.mark.parametrize("seed", range(5))
def test_up_step_diagonals(seed):
    rng = np.random.default_rng(seed)
    n_valid = int(rng.integers(1, 17))
    tokens = rng.integers(0, 32, 16)  # entry -> token row of x_s
    columns = rng.integers(0, 256, 16)  # entry -> slab row
    x_s, slab = rng.normal(size=(32, 64)), rng.normal(size=(256, 64))
    valid = np.arange(16) < n_valid
    token = np.where(valid, tokens, 0)  # lanes 0-15 hold entry `lane`; padding: token 0, column 0
    column = np.where(valid, columns, 0)
    a_row = (LANES & 7) | (LANES & 8)
    a_half = LANES >> 4
    b_entry = (LANES & 7) | ((LANES >> 4) << 3)
    b_half = (LANES >> 3) & 1
    d_lo, d_hi = np.zeros((32, 4)), np.zeros((32, 4))
    for ks in range(4):
        a = ldmatrix_x4([x_s[token[a_row[l]], (2 * ks + a_half[l]) * 8 :][:8] for l in range(32)])
        bb = ldmatrix_x4([slab[column[b_entry[l]], (2 * ks + b_half[l]) * 8 :][:8] for l in range(32)])
        d_lo = mma_m16n8k16(a, bb[:, 0:2], d_lo)
        d_hi = mma_m16n8k16(a, bb[:, 2:4], d_hi)
    got = np.full(16, np.nan)
    for lane in range(32):
        diag = lane >> 2
        if (lane & 3) == (diag >> 1):
            odd = diag & 1
            got[diag] = d_lo[lane, 1 if odd else 0]
            got[8 + diag] = d_hi[lane, 3 if odd else 2]
    want = np.einsum("ed,ed->e", x_s[tokens], slab[columns])
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_down_step_accumulates_per_token(seed):
    rng = np.random.default_rng(seed)
    d_cols, y = 32, np.zeros((32, 32))
    slab = rng.normal(size=(256, d_cols))
    acc = np.zeros((2, 4, 32, 4))  # [row block][column block][lane][fragment]
    b_entry = (LANES & 7) | (((LANES >> 3) & 1) << 3)
    b_chunk = LANES >> 4
    g, t = LANES >> 2, LANES & 3
    for _ in range(3):  # three warp steps of 16 entries over the warp's 32 tokens
        n_valid = int(rng.integers(1, 17))
        tok = np.sort(rng.integers(0, 32, 16))  # a warp's run: entries sorted by token
        col = rng.integers(0, 256, 16)
        h = rng.normal(size=16)
        valid = np.arange(16) < n_valid
        for e in range(16):
            if valid[e]:
                y[tok[e]] += h[e] * slab[col[e]]
        # packed words: (h, token) or 'no token'; column 0 for padding
        p_tok = np.where(valid, tok, 0xFF)
        p_h = np.where(valid, h, 0.0)
        c = np.where(valid, col, 0)
        bf = [ldmatrix_x4([slab[c[b_entry[l]], (2 * q + b_chunk[l]) * 8 :][:8] for l in range(32)], trans=True) for q in range(2)]

        def pick(e, row):
            return np.where(p_tok[e] == row, p_h[e], 0.0)

        for rb in range(2):
            r0, r1 = rb * 16 + g, rb * 16 + g + 8
            a = np.zeros((32, 4, 2))
            a[:, 0] = np.stack([pick(2 * t, r0), pick(2 * t + 1, r0)], -1)
            a[:, 1] = np.stack([pick(2 * t, r1), pick(2 * t + 1, r1)], -1)
            a[:, 2] = np.stack([pick(2 * t + 8, r0), pick(2 * t + 9, r0)], -1)
            a[:, 3] = np.stack([pick(2 * t + 8, r1), pick(2 * t + 9, r1)], -1)
            for nb in range(4):
                b = bf[nb // 2][:, 2 * (nb % 2) : 2 * (nb % 2) + 2]
                acc[rb, nb] = mma_m16n8k16(a, b, acc[rb, nb])
    got = np.zeros((32, 32))
    for rb in range(2):
        for half in range(2):
            for nb in range(4):
                for lane in range(32):
                    row = rb * 16 + g[lane] + 8 * half
                    got[row, nb * 8 + 2 * t[lane] : nb * 8 + 2 * t[lane] + 2] = acc[rb, nb, lane, 2 * half : 2 * half + 2]
    np.testing.assert_allclose(got, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m,d,splits", [(1, 128, 2), (8, 64, 1), (17, 256, 3), (64, 48, 1), (40, 320, 4)])
def test_decode_gate_fragments(m, d, splits):
    """TwellDecodeGateKernel (ffi/twell_decode.cu): W rows and x columns stored into a stage
    with the chunk swizzles q ^ (r & 7) and q ^ (m & 7), A (W^T) gathered back by
    ldmatrix.trans and B (x) by ldmatrix at the kernel's lane addresses, D scattered to the
    padded partial tile, the K ranges' tiles summed per (token, column): the eight warps'
    128 columns for every token equal x @ W."""
    rng = np.random.default_rng(m + d)
    cols, k_stage, stride = 128, 64, 132
    x, w = rng.normal(size=(m, d)), rng.normal(size=(d, cols))
    n_tok = 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64  # the kernel's kNT = n_tok / 8
    g, t = LANES >> 2, LANES & 3
    n_chunks = -(-d // k_stage)
    tiles = []
    for split in range(splits):
        c0, c1 = n_chunks * split // splits, n_chunks * (split + 1) // splits
        red = np.full((n_tok, stride), np.nan)
        for warp in range(8):
            acc = np.zeros((n_tok // 8, 32, 4))
            for c in range(c0, c1):
                ws = np.zeros((k_stage, cols))  # physical layouts: 16 (W) and 8 (x) chunks of 8 per row
                xs = np.zeros((n_tok, k_stage))
                for r in range(k_stage):
                    for q in range(cols // 8):
                        if c * k_stage + r < d:
                            ws[r, (q ^ (r & 7)) * 8 :][:8] = w[c * k_stage + r, q * 8 : q * 8 + 8]
                for row in range(min(m, n_tok)):
                    for q in range(k_stage // 8):
                        k = c * k_stage + q * 8
                        if k < d:
                            xs[row, (q ^ (row & 7)) * 8 :][:8] = x[row, k : k + 8]
                for ks in range(k_stage // 16):
                    a_k = (LANES & 7) + ((LANES >> 4) & 1) * 8
                    a_chunk = 2 * warp + ((LANES >> 3) & 1)
                    r = ks * 16 + a_k
                    a = ldmatrix_x4([ws[r[l], (a_chunk[l] ^ (r[l] & 7)) * 8 :][:8] for l in range(32)], trans=True)
                    b_chunk = (LANES >> 3) & 1
                    if n_tok == 8:  # x2: lanes 0-15 address matrices 0 and 1
                        row = LANES & 7
                        q = 2 * ks + b_chunk
                        b = ldmatrix_x4([xs[row[l % 16], (q[l % 16] ^ (row[l % 16] & 7)) * 8 :][:8] for l in range(32)])
                        acc[0] = mma_m16n8k16(a, b[:, 0:2], acc[0])
                    else:
                        for p in range(n_tok // 16):
                            row = p * 16 + (LANES & 7) + ((LANES >> 4) & 1) * 8
                            q = 2 * ks + b_chunk
                            b = ldmatrix_x4([xs[row[l], (q[l] ^ (row[l] & 7)) * 8 :][:8] for l in range(32)])
                            acc[2 * p] = mma_m16n8k16(a, b[:, 0:2], acc[2 * p])
                            acc[2 * p + 1] = mma_m16n8k16(a, b[:, 2:4], acc[2 * p + 1])
            col, tok = warp * 16 + (LANES >> 2), 2 * (LANES & 3)
            for nt in range(n_tok // 8):
                for lane in range(32):
                    red[nt * 8 + tok[lane], col[lane]] = acc[nt, lane, 0]
                    red[nt * 8 + tok[lane] + 1, col[lane]] = acc[nt, lane, 1]
                    red[nt * 8 + tok[lane], col[lane] + 8] = acc[nt, lane, 2]
                    red[nt * 8 + tok[lane] + 1, col[lane] + 8] = acc[nt, lane, 3]
        tiles.append(red)
    out = sum(tile[:m, :cols] for tile in tiles)  # the cluster's reduction, rank order
    np.testing.assert_allclose(out, x @ w, rtol=1e-9, atol=1e-9)
    assert not np.isnan(np.stack(tiles)[:, :, :cols]).any()  # every (token, column) written


# The backup products (GemmPhase of BackupKernel, ffi/twell_backup.cu): 64 x 64 x 32 tiles, four warps of 32 x 32, padded
# shared-memory rows (A: 40 elements, B: 72), 128 threads copying two 16-byte pieces each.
BM, BN, BK, A_STRIDE, B_STRIDE, THREADS = 64, 64, 32, 40, 72, 128


def _backup_tile(a_rows, b, row0, col0, count):
    """One output tile of the kernel, emulated from its index formulas: ``a_rows[i]`` the
    (gathered) A row of list position i, ``b`` [K, N]; returns C [BM, BN] (NaN where the
    epilogue writes nothing) and the shared-memory row addresses each ldmatrix phase reads."""
    k, n = b.shape
    acc = np.zeros((4, 2, 4, 32, 4))  # warp, mi, ni, lane, reg
    phases = []
    for ks in range(-(-k // BK)):
        k0 = ks * BK
        sa = np.full(BM * A_STRIDE, np.nan)
        sb = np.full(BK * B_STRIDE, np.nan)
        for tid in range(THREADS):
            for j in range(2):
                q = tid + j * THREADS
                r, kc = q >> 2, (q & 3) * 8
                ok = row0 + r < count and k0 + kc < k
                sa[r * A_STRIDE + kc: r * A_STRIDE + kc + 8] = a_rows[row0 + r, k0 + kc: k0 + kc + 8] if ok else 0
                br, nc = q >> 3, (q & 7) * 8
                ok = col0 + nc < n and k0 + br < k
                sb[br * B_STRIDE + nc: br * B_STRIDE + nc + 8] = b[k0 + br, col0 + nc: col0 + nc + 8] if ok else 0
        for warp in range(4):
            wm, wn = warp // 2, warp % 2
            for kk in (0, 16):
                af = []
                for mi in range(2):
                    addr = [(wm * 32 + mi * 16 + (l & 15)) * A_STRIDE + kk + (l >> 4) * 8 for l in LANES]
                    phases.append(addr)
                    af.append(ldmatrix_x4([sa[p: p + 8] for p in addr]))
                bf = [None] * 4
                for nj in range(2):
                    addr = [(kk + ((l >> 3) & 1) * 8 + (l & 7)) * B_STRIDE + wn * 32 + nj * 16 + (l >> 4) * 8
                            for l in LANES]
                    phases.append(addr)
                    r = ldmatrix_x4([sb[p: p + 8] for p in addr], trans=True)
                    bf[2 * nj], bf[2 * nj + 1] = r[:, 0:2], r[:, 2:4]
                for mi in range(2):
                    for ni in range(4):
                        acc[warp, mi, ni] = mma_m16n8k16(af[mi], bf[ni], acc[warp, mi, ni])
    c = np.full((BM, BN), np.nan)
    for warp in range(4):
        wm, wn = warp // 2, warp % 2
        for lane in LANES:
            for mi in range(2):
                for half in range(2):
                    i = wm * 32 + mi * 16 + (lane >> 2) + half * 8
                    if row0 + i >= count:
                        continue
                    for ni in range(4):
                        col = wn * 32 + ni * 8 + (lane & 3) * 2
                        if col0 + col >= n:
                            continue
                        c[i, col: col + 2] = acc[warp, mi, ni, lane, 2 * half: 2 * half + 2]
    return c, phases


@pytest.mark.parametrize("k,n,count,row0,col0", [(96, 128, 64, 0, 64), (40, 72, 37, 0, 64), (8, 8, 1, 0, 0),
                                                 (200, 136, 130, 64, 64)])
def test_backup_gemm_tile(k, n, count, row0, col0):
    """Each written element of a tile is its row of A times its column of B (K and N tails
    zero-filled, rows past the count and columns past N left alone), and no ldmatrix phase
    of eight 16-byte rows meets a shared-memory bank twice."""
    rng = np.random.default_rng(k + n + count)
    a_rows = np.zeros((max(count, row0 + BM), k))
    a_rows[:count] = rng.normal(size=(count, k))
    b = rng.normal(size=(k, n))
    c, phases = _backup_tile(a_rows, b, row0, col0, count)
    rows = min(BM, count - row0)
    cols = min(BN, n - col0)
    want = a_rows[row0: row0 + rows] @ b[:, col0: col0 + cols]
    np.testing.assert_allclose(c[:rows, :cols], want, rtol=1e-10, atol=1e-10)
    assert np.isnan(c[rows:]).all() and np.isnan(c[:, cols:]).all()
    for addr in phases:
        for p in range(4):  # one 8x8 matrix per phase: eight 16-byte rows
            groups = {(2 * a // 16) % 8 for a in addr[8 * p: 8 * p + 8]}
            assert len(groups) == 8, "bank conflict"
