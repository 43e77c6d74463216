"""Conformance cases that fail today, grouped by cause: {cause: [patterns]}.

A pattern is chip:op[.variant]:dtype:direction (fnmatch wildcards allowed; "*" as the chip means
both chips). The list only shrinks: the sweep fails on a failing case that is not listed, and on
a listed pattern whose cases now all pass (fixed: remove it). Each cause names the issue item
that tracks it; the minimal repro of each is in docs/conformance.md.
"""


def cases(chip, kind, names):
    """Patterns for the ops in `names` (space-separated) on chip, kind = "dtype:direction"."""
    return [f"{chip}:{op}:{kind}" for op in names.split()]


EXPECTED = {
    # z.conj() * z on flagos is z * z; every complex gradient multiplies by conj(x) or uses mH.
    "conj/neg bits lost through __torch_dispatch__: complex gradients, mH and conj-based ops "
    "come out unconjugated (issue item 1)": [
        *cases("*", "complex64:bwd", """
            __rdiv__ __rmatmul__ __rmul__ __rpow__ acos acosh addcdiv addcmul addmv addr asin
            asinh atan atanh cholesky corrcoef cos cosh cov cross cumprod cumulative_trapezoid
            div.no_rounding_mode dot einsum exp exp2 expm1 fft.hfftn float_power inner kron
            ldexp linalg.cholesky linalg.cholesky_ex linalg.cross linalg.det linalg.eig
            linalg.eigh linalg.eigvals linalg.householder_product linalg.lstsq
            linalg.lstsq.grad_oriented linalg.pinv linalg.pinv.hermitian linalg.pinv.singular
            linalg.qr linalg.slogdet linalg.vander linalg.vecdot log log10 log1p log2 logaddexp
            logcumsumexp logdet logsumexp masked.cumprod masked.normalize masked.std masked.var
            matmul matrix_exp mul mv nn.functional.normalize nn.functional.rms_norm
            nn.functional.softsign ormqr outer pinverse pow prod qr reciprocal renorm rsqrt sgn
            sin sinc sinh sqrt square tan tensordot trapezoid trapz true_divide vdot"""),
        *cases("*", "complex64:fwd", """
            fft.hfft fft.hfft2 fft.hfftn linalg.lstsq linalg.lstsq.grad_oriented linalg.pinv
            linalg.pinv.singular masked.std masked.var pinverse"""),
        *cases("*", "float32:bwd", "fft.ifft linalg.eig linalg.eigvals polar"),
        *cases("*", "float32:fwd", "fft.hfftn"),
        *cases("*", "int64:fwd", "fft.hfftn"),
    ],
    # sim's _conj view keeps only metadata: x.conj().cpu(), .H, .mH read unconjugated bytes, and
    # so does everything that conjugates on the way (ifft of a real input, mm backward, ...).
    "sim: the conj view keeps only metadata, so conj(), .H, .mH and what is built on them read "
    "unconjugated data (issue item 1, sim)": [
        *cases("sim", "complex64:bwd", """
            H addbmm addmm addmm.decomposed baddbmm bmm conj fft.hfft fft.hfft2 linalg.eigvalsh
            linalg.inv linalg.inv_ex linalg.lu linalg.lu_factor linalg.lu_factor_ex
            linalg.lu_solve linalg.matrix_power linalg.multi_dot linalg.solve linalg.solve_ex
            linalg.solve_triangular linalg.tensorinv linalg.tensorsolve lu lu_solve mH mm
            nn.functional.linear triangular_solve"""),
        *cases("sim", "complex64:fwd", "H conj corrcoef cov linalg.lu_solve mH"),
        *cases("sim", "float32:bwd", "fft.hfft2 fft.hfftn fft.ihfft fft.ihfft2 fft.ihfftn"),
        *cases("sim", "float32:fwd", "fft.hfft2 fft.ifft fft.ihfft fft.ihfft2 fft.ihfftn"),
        *cases("sim", "int64:fwd", "fft.hfft2 fft.ifft fft.ihfft fft.ihfft2 fft.ihfftn"),
    ],
    # hfft's backward raises (view_as_real of an unresolved conj tensor, item 1) inside the
    # autograd engine, and any exception there ends the process.
    "an exception raised inside backward aborts the process: 'terminate called without an "
    "active exception' (issue item 5)": [
        *cases("cpu", "float32:bwd", "fft.hfft fft.hfft2 fft.hfftn"),
    ],
    "sim: a storage-less tensor (sgn's backward makes an _efficientzerotensor) is uploaded "
    "through a null data pointer: SIGSEGV (issue item 6)": [
        "sim:sgn:float32:bwd",
    ],
    "sparse inputs reach the router and fail with internal messages ('Sparse CSR tensors do "
    "not have strides', 'unsupported memory format option Contiguous') (issue item 13)": [
        *cases("*", "float32:fwd", "sparse.mm.reduce sparse.sampled_addmm"),
        *cases("*", "float32:bwd", "sparse.mm.reduce sparse.sampled_addmm"),
        *cases("*", "float16:fwd", "sparse.mm.reduce"),
        *cases("*", "bfloat16:fwd", "sparse.mm.reduce"),
        *cases("*", "complex64:fwd", "sparse.sampled_addmm"),
        *cases("*", "complex64:bwd", "sparse.sampled_addmm"),
        *cases("sim", "*:*", "to_sparse"),
    ],
    # Column-major LAPACK results, rot90's and fft's permuted outputs, channels_last .to():
    # CPU gives dense non-row-major strides, sim gives row-major.
    "sim: results come back row-major where CPU's are dense with other strides (issue item 12)": [
        *cases("sim", "float32:fwd", """
            argwhere cholesky fft.fft fft.fft2 fft.hfft fft.ifft2 fft.irfft fft.irfft2 fft.rfft
            fft.rfft2 geqrf linalg.cholesky linalg.cholesky_ex linalg.eig linalg.eigh
            linalg.householder_product linalg.inv linalg.inv_ex linalg.ldl_factor
            linalg.ldl_factor_ex linalg.ldl_solve linalg.lstsq linalg.lstsq.grad_oriented
            linalg.lu_factor linalg.lu_factor_ex linalg.lu_solve linalg.qr linalg.solve
            linalg.solve_ex linalg.tensorinv lu lu_solve ormqr qr rot90 to triangular_solve"""),
        *cases("sim", "float32:bwd", """
            cholesky fft.fft fft.rfft linalg.cholesky linalg.cholesky_ex linalg.det
            linalg.lstsq linalg.lstsq.grad_oriented linalg.lu_solve linalg.pinv
            linalg.pinv.hermitian linalg.qr linalg.slogdet linalg.solve linalg.solve_ex logdet
            lu_solve ormqr pinverse qr rot90 tensordot triangular_solve"""),
        *cases("sim", "complex64:fwd", """
            argwhere cholesky fft.fft fft.fft2 fft.ifft fft.ifft2 fft.irfft fft.irfft2 geqrf
            linalg.cholesky linalg.cholesky_ex linalg.eig linalg.eigh linalg.householder_product
            linalg.inv linalg.inv_ex linalg.ldl_factor linalg.ldl_factor_ex linalg.ldl_solve
            linalg.lu_factor linalg.lu_factor_ex linalg.qr linalg.solve linalg.solve_ex
            linalg.tensorinv lu lu_solve ormqr qr rot90 to triangular_solve"""),
        *cases("sim", "complex64:bwd", """
            fft.fft fft.fft2 fft.ifft fft.ifft2 fft.irfft fft.irfft2 rot90"""),
        *cases("sim", "float16:fwd", "argwhere rot90 to"),
        *cases("sim", "bfloat16:fwd", "argwhere rot90 to"),
        *cases("sim", "int64:fwd", """
            argwhere fft.fft fft.fft2 fft.hfft fft.ifft2 fft.irfft fft.irfft2 fft.rfft fft.rfft2
            rot90 to"""),
    ],
    # Every aten op of the backward returns the same strides on both sides (checked with a
    # dispatch mode); the difference appears after them, in how the gradient reaches the leaf.
    "cpu chip: ormqr's input gradient is row-major where CPU's is column-major (cause not "
    "pinned down yet)": [
        "cpu:ormqr:float32:bwd",
    ],
}
