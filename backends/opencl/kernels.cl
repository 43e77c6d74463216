/* OpenCL C kernels of the opencl adapter (host side: kernels.c), built once per device and
 * dtype: -DDT_FLOAT, -DDT_HALF (storage only: computed in float, stored rounded to nearest
 * even) or -DDT_DOUBLE; -DHAVE_FP64 when the device has doubles, for the transcendental
 * functions of float and half (computed in double, then rounded, as PyTorch's own CPU
 * results are within an ulp of the exact value).
 *
 * Every tensor is a strided view: sizes and per-operand strides of up to 8 dims and an
 * element offset travel in an `nd` struct passed by value. Sums accumulate in ACC (float,
 * double for double tensors) with Kahan compensation. Formulas follow PyTorch's CPU kernels:
 * add is fma(alpha, b, a), silu x * sigmoid(x), gelu the erf or tanh form, softmax subtracts
 * the row's max, layer_norm uses the biased variance and 1 / sqrt(var + eps).
 */
#pragma OPENCL FP_CONTRACT OFF

#if defined(DT_DOUBLE) || defined(HAVE_FP64)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif

#if defined(DT_DOUBLE)
typedef double T;
typedef double ACC;
#define LD(p, i) ((p)[i])
#define ST(p, i, v) ((p)[i] = (v))
#elif defined(DT_HALF)
typedef half T;
typedef float ACC;
#define LD(p, i) vload_half((size_t)(i), (p))
#define ST(p, i, v) vstore_half_rte((float)(v), (size_t)(i), (p))
#else
typedef float T;
typedef float ACC;
#define LD(p, i) ((p)[i])
#define ST(p, i, v) ((p)[i] = (v))
#endif

#if defined(DT_DOUBLE) || defined(HAVE_FP64)
typedef double M; /* transcendental functions */
#else
typedef float M;
#endif

#define MAX_DIMS 8

/* Sizes of up to 8 dims, with the strides (in elements) and start offsets of up to four
 * operands walked together. Laid out as the host's struct (all 8-byte fields first). */
typedef struct nd {
    long size[MAX_DIMS];
    long stride[4][MAX_DIMS];
    long offset[4];
    long n;      /* product of the sizes */
    int ndim;
    int pad;
} nd;

/* The element offsets of the first `k` operands at row-major index `idx`. */
inline void nd_at(const nd *s, long idx, int k, long *off)
{
    for (int o = 0; o < k; o++)
        off[o] = s->offset[o];
    for (int d = s->ndim - 1; d >= 0; d--) {
        long size = s->size[d];
        long c = idx % size;
        idx /= size;
        for (int o = 0; o < k; o++)
            off[o] += c * s->stride[o][d];
    }
}

/* ---- elementwise -------------------------------------------------------- */

enum {
    OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_ADD_SCALAR, OP_SUB_SCALAR, OP_MUL_SCALAR, OP_DIV_SCALAR,
    OP_NEG, OP_RELU, OP_SILU, OP_SIGMOID, OP_TANH, OP_EXP, OP_GELU, OP_GELU_TANH, OP_COPY
};

inline ACC apply(int op, ACC x, ACC y, ACC s0, ACC s1)
{
    M m = (M)x;
    switch (op) {
    case OP_ADD: return fma(s0, y, x);
    case OP_SUB: return fma(-s0, y, x);
    case OP_MUL: return x * y;
    case OP_DIV: return x / y;
    case OP_ADD_SCALAR: return fma(s1, s0, x);
    case OP_SUB_SCALAR: return fma(-s1, s0, x);
    case OP_MUL_SCALAR: return x * s0;
    case OP_DIV_SCALAR: return x / s0;
    case OP_NEG: return -x;
    case OP_COPY: return x;
    case OP_RELU: return x < (ACC)0 ? (ACC)0 : x; /* NaN and -0.0 pass through */
    case OP_SILU: return (ACC)(m / ((M)1 + exp(-m)));
    case OP_SIGMOID: return (ACC)((M)1 / ((M)1 + exp(-m)));
    case OP_TANH: return (ACC)tanh(m);
    case OP_EXP: return (ACC)exp(m);
    case OP_GELU: return (ACC)((M)0.5 * m * ((M)1 + erf(m * (M)0.70710678118654752440)));
    case OP_GELU_TANH: {
        M inner = (M)0.79788456080286535588 * (m + (M)0.044715 * m * m * m);
        return (ACC)((M)0.5 * m * ((M)1 + tanh(inner)));
    }
    default: return x;
    }
}

__kernel void elementwise(__global T *out, __global const T *a, __global const T *b, nd s,
                          int op, ACC s0, ACC s1)
{
    long off[3];
    for (long i = get_global_id(0); i < s.n; i += get_global_size(0)) {
        nd_at(&s, i, 3, off);
        ACC x = LD(a, off[1]);
        ACC y = op <= OP_DIV ? LD(b, off[2]) : (ACC)0;
        ST(out, off[0], apply(op, x, y, s0, s1));
    }
}

/* ---- matrix products ---------------------------------------------------- */

typedef struct mm_shape {
    long m, n, k, batches;
    long a[4];   /* offset, batch, row and column strides */
    long b[4];
    long c[4];   /* addmm's self (batch stride unused) */
    long o[4];
} mm_shape;

/* out = alpha * a@b (+ beta * c when use_c); one work item per output element, k ascending.
 * As in BLAS, c is not read when beta is 0 and a@b is not formed when alpha is 0. */
__kernel void matmul(__global T *out, __global const T *a, __global const T *b,
                     __global const T *c, mm_shape s, ACC alpha, ACC beta, int use_c)
{
    long j = get_global_id(0), i = get_global_id(1), batch = get_global_id(2);
    if (j >= s.n || i >= s.m || batch >= s.batches)
        return;
    ACC acc = 0;
    if (alpha != (ACC)0) {
        long pa = s.a[0] + batch * s.a[1] + i * s.a[2];
        long pb = s.b[0] + batch * s.b[1] + j * s.b[3];
        for (long k = 0; k < s.k; k++)
            acc = fma((ACC)LD(a, pa + k * s.a[3]), (ACC)LD(b, pb + k * s.b[2]), acc);
        acc = alpha == (ACC)1 ? acc : alpha * acc;
    }
    if (use_c && beta != (ACC)0)
        acc = fma(beta, (ACC)LD(c, s.c[0] + i * s.c[2] + j * s.c[3]), acc);
    ST(out, s.o[0] + batch * s.o[1] + i * s.o[2] + j * s.o[3], acc);
}

/* ---- reductions --------------------------------------------------------- */

typedef struct kahan {
    ACC sum, c;
} kahan;

inline void kahan_add(kahan *k, ACC x)
{
    ACC y = x - k->c;
    ACC t = k->sum + y;
    k->c = (t - k->sum) - y;
    k->sum = t;
}

/* The sum of the elements `inner` walks from `base` (operand 0 of inner). */
inline ACC sum_from(__global const T *in, long base, const nd *inner)
{
    kahan acc = {0, 0};
    long off[1];
    for (long r = 0; r < inner->n; r++) {
        nd_at(inner, r, 1, off);
        ACC x = LD(in, base + off[0]);
        if (isinf(x) || isnan(x)) { /* compensation would turn inf into NaN */
            acc.sum += x;
            acc.c = 0;
        } else {
            kahan_add(&acc, x);
        }
    }
    return acc.sum;
}

/* outer: kept dims (operand 0: in, 1: out); inner: reduced dims (operand 0: in). */
__kernel void reduce(__global T *out, __global const T *in, nd outer, nd inner, int mean)
{
    long off[2];
    for (long i = get_global_id(0); i < outer.n; i += get_global_size(0)) {
        nd_at(&outer, i, 2, off);
        ACC sum = sum_from(in, off[0], &inner);
        ST(out, off[1], mean ? sum / (ACC)inner.n : sum);
    }
}

/* ---- softmax ------------------------------------------------------------- */

/* outer: every dim but the softmax one (operand 0: in, 1: out); one work item per row.
 * safe (_safe_softmax): a row of -inf only is zeros, not NaN. */
__kernel void softmax(__global T *out, __global const T *in, nd outer, long len, long in_stride,
                      long out_stride, int safe)
{
    long off[2];
    for (long i = get_global_id(0); i < outer.n; i += get_global_size(0)) {
        nd_at(&outer, i, 2, off);
        ACC max = -INFINITY;
        for (long k = 0; k < len; k++) {
            ACC x = LD(in, off[0] + k * in_stride);
            if (x > max || isnan(x))
                max = x;
            if (isnan(max))
                break;
        }
        if (safe && max == -INFINITY) {
            for (long k = 0; k < len; k++)
                ST(out, off[1] + k * out_stride, (ACC)0);
            continue;
        }
        kahan sum = {0, 0};
        for (long k = 0; k < len; k++)
            kahan_add(&sum, (ACC)exp((M)LD(in, off[0] + k * in_stride) - (M)max));
        for (long k = 0; k < len; k++) {
            ACC e = (ACC)exp((M)LD(in, off[0] + k * in_stride) - (M)max);
            ST(out, off[1] + k * out_stride, e / sum.sum);
        }
    }
}

/* ---- layer norm ------------------------------------------------------------ */

/* rows: the leading dims (operands x, y, mean, rstd); norm: the normalized dims (operands x,
 * y, weight, bias, the latter two with their offsets). One work item per row. */
__kernel void layer_norm(__global T *y, __global T *mean_out, __global T *rstd_out,
                         __global const T *x, __global const T *w, __global const T *b,
                         nd rows, nd norm, int has_w, int has_b, ACC eps)
{
    long r_off[4], n_off[4];
    for (long i = get_global_id(0); i < rows.n; i += get_global_size(0)) {
        nd_at(&rows, i, 4, r_off);
        ACC mean = norm.n > 0 ? sum_from(x, r_off[0], &norm) / (ACC)norm.n : (ACC)0;
        kahan sq = {0, 0};
        for (long k = 0; k < norm.n; k++) {
            nd_at(&norm, k, 1, n_off);
            ACC d = LD(x, r_off[0] + n_off[0]) - mean;
            kahan_add(&sq, d * d);
        }
        ACC var = norm.n > 0 ? sq.sum / (ACC)norm.n : (ACC)NAN;
        ACC rstd = (ACC)1 / sqrt(var + eps);
        for (long k = 0; k < norm.n; k++) {
            nd_at(&norm, k, 4, n_off);
            ACC v = (LD(x, r_off[0] + n_off[0]) - mean) * rstd;
            if (has_w)
                v = v * LD(w, n_off[2]);
            if (has_b)
                v = v + LD(b, n_off[3]);
            ST(y, r_off[1] + n_off[1], v);
        }
        ST(mean_out, r_off[2], mean);
        ST(rstd_out, r_off[3], rstd);
    }
}

/* ---- convolution ------------------------------------------------------------ */

typedef struct conv_shape {
    long n, cin, h, w, cout, kh, kw, oh, ow, groups;
    long stride[2], pad[2], dilation[2];
    long x[5];   /* offset, then strides of N, C, H, W */
    long wt[5];  /* offset, then strides of Cout, Cin/groups, kH, kW */
    long b[2];   /* offset, stride */
    long o[5];
} conv_shape;

/* Direct 2-d convolution, zero padding. One work item per output pixel and tile of CO_TILE
 * output channels of one group (adjacent items: adjacent output columns), so each input
 * element loaded serves the whole tile; taps accumulate with fma in (ci, ky, kx) order. */
#define CO_TILE 8

__kernel void conv2d(__global T *out, __global const T *x, __global const T *w,
                     __global const T *b, conv_shape s, int has_bias)
{
    long cin_g = s.cin / s.groups, cout_g = s.cout / s.groups;
    long tiles = (cout_g + CO_TILE - 1) / CO_TILE;
    long total = s.n * s.groups * tiles * s.oh * s.ow;
    for (long i = get_global_id(0); i < total; i += get_global_size(0)) {
        long ow = i % s.ow, t = i / s.ow;
        long oh = t % s.oh;
        t /= s.oh;
        long tile = t % tiles;
        t /= tiles;
        long g = t % s.groups, n = t / s.groups;
        long co0 = g * cout_g + tile * CO_TILE;
        long count = min((long)CO_TILE, cout_g - tile * CO_TILE);
        long ih0 = oh * s.stride[0] - s.pad[0], iw0 = ow * s.stride[1] - s.pad[1];
        ACC acc[CO_TILE];
        for (int c = 0; c < CO_TILE; c++)
            acc[c] = 0;
        for (long ci = 0; ci < cin_g; ci++) {
            long xb = s.x[0] + n * s.x[1] + (g * cin_g + ci) * s.x[2];
            long wb = s.wt[0] + co0 * s.wt[1] + ci * s.wt[2];
            for (long ky = 0; ky < s.kh; ky++) {
                long ih = ih0 + ky * s.dilation[0];
                if (ih < 0 || ih >= s.h)
                    continue;
                for (long kx = 0; kx < s.kw; kx++) {
                    long iw = iw0 + kx * s.dilation[1];
                    if (iw < 0 || iw >= s.w)
                        continue;
                    ACC xv = LD(x, xb + ih * s.x[3] + iw * s.x[4]);
                    long wp = wb + ky * s.wt[3] + kx * s.wt[4];
                    /* a partial tile repeats its last channel (never stored): no branch here */
                    for (int c = 0; c < CO_TILE; c++)
                        acc[c] = fma(xv, (ACC)LD(w, wp + min((long)c, count - 1) * s.wt[1]), acc[c]);
                }
            }
        }
        long o = s.o[0] + n * s.o[1] + oh * s.o[3] + ow * s.o[4];
        for (int c = 0; c < CO_TILE; c++)
            if (c < count)
                ST(out, o + (co0 + c) * s.o[2],
                   has_bias ? acc[c] + (ACC)LD(b, s.b[0] + (co0 + c) * s.b[1]) : acc[c]);
    }
}

/* ---- group norm -------------------------------------------------------------- */

typedef struct group_norm_shape {
    long n, c, hxw, group;
    long x[4];      /* offset, strides of N, C, HxW */
    long y[4];
    long wt[2];     /* offset, stride */
    long b[2];
    long mean[3];   /* offset, strides of N, group */
    long rstd[3];
} group_norm_shape;

/* One work item per (sample, group): Kahan-compensated mean, then the biased variance about
 * it, then y = (x - mean) * rstd * weight + bias. */
__kernel void group_norm(__global T *y, __global T *mean_out, __global T *rstd_out,
                         __global const T *x, __global const T *w, __global const T *b,
                         group_norm_shape s, int has_w, int has_b, ACC eps)
{
    long per = s.c / s.group;
    for (long i = get_global_id(0); i < s.n * s.group; i += get_global_size(0)) {
        long n = i / s.group, g = i % s.group;
        long count = per * s.hxw;
        kahan sum = {0, 0};
        for (long ch = g * per; ch < (g + 1) * per; ch++)
            for (long k = 0; k < s.hxw; k++)
                kahan_add(&sum, LD(x, s.x[0] + n * s.x[1] + ch * s.x[2] + k * s.x[3]));
        ACC mean = count > 0 ? sum.sum / (ACC)count : (ACC)0;
        kahan sq = {0, 0};
        for (long ch = g * per; ch < (g + 1) * per; ch++)
            for (long k = 0; k < s.hxw; k++) {
                ACC d = LD(x, s.x[0] + n * s.x[1] + ch * s.x[2] + k * s.x[3]) - mean;
                kahan_add(&sq, d * d);
            }
        ACC rstd = (ACC)1 / sqrt((count > 0 ? sq.sum / (ACC)count : (ACC)NAN) + eps);
        for (long ch = g * per; ch < (g + 1) * per; ch++) {
            ACC scale = has_w ? rstd * (ACC)LD(w, s.wt[0] + ch * s.wt[1]) : rstd;
            ACC shift = has_b ? (ACC)LD(b, s.b[0] + ch * s.b[1]) : (ACC)0;
            for (long k = 0; k < s.hxw; k++) {
                ACC v = LD(x, s.x[0] + n * s.x[1] + ch * s.x[2] + k * s.x[3]) - mean;
                ST(y, s.y[0] + n * s.y[1] + ch * s.y[2] + k * s.y[3], v * scale + shift);
            }
        }
        ST(mean_out, s.mean[0] + n * s.mean[1] + g * s.mean[2], mean);
        ST(rstd_out, s.rstd[0] + n * s.rstd[1] + g * s.rstd[2], rstd);
    }
}

/* ---- nearest upsampling ------------------------------------------------------- */

typedef struct upsample_shape {
    long n, c, h, w, oh, ow;
    long x[5];   /* offset, strides of N, C, H, W */
    long o[5];
} upsample_shape;

/* PyTorch's nearest_idx(); scale is the float source step the host computed as PyTorch does. */
inline long nearest_source(long i, long in_size, long out_size, float scale)
{
    if (out_size == in_size)
        return i;
    if (out_size == 2 * in_size)
        return i >> 1;
    long src = (long)floor((float)i * scale);
    return src < in_size - 1 ? src : in_size - 1;
}

__kernel void upsample_nearest2d(__global T *out, __global const T *x, upsample_shape s,
                                 float scale_h, float scale_w)
{
    long total = s.n * s.c * s.oh * s.ow;
    for (long i = get_global_id(0); i < total; i += get_global_size(0)) {
        long ow = i % s.ow, t = i / s.ow;
        long oh = t % s.oh;
        t /= s.oh;
        long ch = t % s.c, n = t / s.c;
        long ih = nearest_source(oh, s.h, s.oh, scale_h);
        long iw = nearest_source(ow, s.w, s.ow, scale_w);
        ST(out, s.o[0] + n * s.o[1] + ch * s.o[2] + oh * s.o[3] + ow * s.o[4],
           LD(x, s.x[0] + n * s.x[1] + ch * s.x[2] + ih * s.x[3] + iw * s.x[4]));
    }
}

/* ---- embedding ------------------------------------------------------------------ */

typedef struct embedding_shape {
    long dim;
    long wt[3];    /* offset, strides of V, D */
    long o_dim;    /* the output's stride along D */
} embedding_shape;

/* rows: the indices' dims (operand 0: indices, 1: output). The host has checked every index
 * against the table's rows before the launch. */
__kernel void embedding(__global T *out, __global const T *w, __global const long *idx,
                        embedding_shape s, nd rows)
{
    long off[2];
    for (long i = get_global_id(0); i < rows.n * s.dim; i += get_global_size(0)) {
        long k = i % s.dim;
        nd_at(&rows, i / s.dim, 2, off);
        long v = idx[off[0]];
        ST(out, off[1] + k * s.o_dim, LD(w, s.wt[0] + v * s.wt[1] + k * s.wt[2]));
    }
}
