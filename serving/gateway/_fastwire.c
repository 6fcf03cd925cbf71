/* serving.gateway._fastwire: a canonically encoded recsys.v1.ScoreRequest -> its columns, in C.
 *
 * The optional native twin of serving/gateway/wire.py's fast path (its `_parse` + `_columns`):
 * the same walk of the top level and of each SparseFeature, the same packed-varint decoding,
 * the same answer for every input (tests/serving/test_wire.py compares the two on random,
 * crafted and fuzzed bytes). Built by `pip install` when a C compiler is there; without it the
 * gateway runs the numpy path, which gives the same arrays.
 *
 *   columns(buf, max_features, dense_width=-1, max_ids=-1) ->
 *     None   the bytes are not the canonical encoding (the caller asks protobuf),
 *     int    the count of `sparse` entries at which there are too many (max_features + 2;
 *            the caller raises check_feature_count's InvalidRequest),
 *     tuple  (num_examples, dense offset, dense byte count, model_version, [names],
 *             ids i64 bytes, ids per feature i64 bytes, lengths i64 bytes,
 *             lengths entries per feature i64 bytes, clean)
 *
 * A feature's ids and lengths may each be packed (one field) or unpacked (a run of one varint
 * field per value, as proto2-style writers emit them): the same values either way.
 * max_features < 0: no bound. No numpy here: arrays leave as bytes (np.frombuffer reads them).
 * clean (given dense_width and max_ids >= 0): every value passes validate.py's checks that need
 * no schema names (num_examples x dense_width finite floats, num_examples lengths per feature,
 * each within [0, max_ids], adding up to the feature's ids, no negative id). False says only
 * that validate.py must look; it then names what is wrong, and this module never does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

enum { NUM_EXAMPLES = 0x08, DENSE = 0x12, SPARSE = 0x1A, MODEL_VERSION = 0x22 };
enum { NAME = 0x0A, IDS = 0x12, LENGTHS = 0x1A };
enum { IDS_VARINT = 0x10, LENGTHS_VARINT = 0x18 }; /* the same fields, one value per field */
enum { RELEASE_GIL = 16384 }; /* varints (at most) above which the decode releases the GIL */
enum { RELEASE_WALK = 65536 }; /* request bytes above which the walk releases it */

typedef struct {
    Py_ssize_t name, name_n, ids, ids_n, lengths, lengths_n; /* offsets and sizes in buf */
    Py_ssize_t ids_count, lengths_count; /* values of an unpacked run; -1: packed */
} Feature;

/* A varint at *pos (below end) -> 0 and *out, or -1: cut, over 10 bytes, or (strict) over 64
 * bits. Not strict, a 10th byte adds its lowest bit only, as the numpy decoder does. */
static int varint(const uint8_t *p, Py_ssize_t *pos, Py_ssize_t end, uint64_t *out, int strict) {
    uint64_t v = 0;
    for (int shift = 0; *pos < end; shift += 7) {
        uint8_t b = p[(*pos)++];
        if (shift == 63 && strict && (b & 0x7F) > 1)
            return -1;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (b < 0x80) {
            *out = v;
            return 0;
        }
        if (shift == 63)
            return -1;
    }
    return -1;
}

/* A length-delimited field's size at *pos -> 0 and *n with *pos past it, when it fits in end. */
static int span(const uint8_t *p, Py_ssize_t *pos, Py_ssize_t end, Py_ssize_t *n) {
    uint64_t v;
    if (varint(p, pos, end, &v, 1) || v > (uint64_t)(end - *pos))
        return -1;
    *n = (Py_ssize_t)v;
    return 0;
}

/* A run of unpacked fields of `tag` at *pos (each the tag, then a varint of at most 10 bytes)
 * -> their count with *pos past them, or -1: a value cut or over 10 bytes. */
static Py_ssize_t run(const uint8_t *p, Py_ssize_t *pos, Py_ssize_t end, uint8_t tag) {
    Py_ssize_t count = 0;
    while (*pos < end && p[*pos] == tag) {
        Py_ssize_t at = *pos + 1, stop = end - at > 10 ? at + 10 : end;
        while (at < stop && p[at] >= 0x80)
            at++;
        if (at == stop)
            return -1;
        *pos = at + 1;
        count++;
    }
    return count;
}

/* One SparseFeature in [pos, end): name, ids, lengths, each at most once and in that order;
 * ids and lengths each one packed field or a run of unpacked ones. */
static int feature(const uint8_t *p, Py_ssize_t pos, Py_ssize_t end, Feature *f) {
    static const uint8_t tags[3] = {NAME, IDS, LENGTHS}, runs[3] = {0, IDS_VARINT, LENGTHS_VARINT};
    Py_ssize_t *at[3] = {&f->name, &f->ids, &f->lengths}, *size[3] = {&f->name_n, &f->ids_n,
                                                                      &f->lengths_n};
    Py_ssize_t *count[3] = {NULL, &f->ids_count, &f->lengths_count};
    for (int k = 0; k < 3; k++) {
        *at[k] = pos;
        *size[k] = 0;
        if (k)
            *count[k] = -1;
        if (pos < end && p[pos] == tags[k]) {
            pos++;
            if (span(p, &pos, end, size[k]))
                return -1;
            *at[k] = pos;
            pos += *size[k];
        } else if (k && pos < end && p[pos] == runs[k]) {
            if ((*count[k] = run(p, &pos, end, runs[k])) < 0)
                return -1;
            *size[k] = pos - *at[k];
        }
    }
    return pos == end ? 0 : -1;
}

#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define WORDS 1
/* A varint of up to 8 bytes from the word at its first byte, without a loop or a branch per
 * byte: its 7-bit groups packed in three shift-and-mask steps (varint.py's numpy pass, per
 * varint). -> its size, or 0 when it is longer than 8 bytes. */
static inline int word_varint(const uint8_t *at, uint64_t *out) {
    uint64_t w;
    memcpy(&w, at, 8);
    uint64_t ends = ~w & 0x8080808080808080ULL; /* the top bit of each byte that ends one */
    if (!ends)
        return 0;
    int size = (__builtin_ctzll(ends) >> 3) + 1;
    uint64_t x = w & 0x7F7F7F7F7F7F7F7FULL;
    if (size < 8)
        x &= (1ULL << (8 * size)) - 1;
    x = (x & 0x007F007F007F007FULL) | ((x & 0x7F007F007F007F00ULL) >> 1);
    x = (x & 0x00003FFF00003FFFULL) | ((x & 0x3FFF00003FFF0000ULL) >> 2);
    x = (x & 0x000000000FFFFFFFULL) | ((x & 0x0FFFFFFF00000000ULL) >> 4);
    *out = x;
    return size;
}
#else
#define WORDS 0
#endif

/* The varint at *pos (below end) -> 0 and *out, *pos past it; -1 if malformed. Words are
 * read up to limit (the request's end), never past it. */
static inline int value(const uint8_t *p, Py_ssize_t *pos, Py_ssize_t end, Py_ssize_t limit,
                        int64_t *out) {
    uint8_t b = p[*pos];
    if (b < 0x80) { /* one byte: the common case for lengths and small ids */
        *out = b;
        (*pos)++;
        return 0;
    }
    uint64_t v;
#if WORDS
    if (*pos + 8 <= limit) {
        int size = word_varint(p + *pos, &v);
        if (size) {
            if (*pos + size > end)
                return -1; /* it ends past the field */
            *out = (int64_t)v;
            *pos += size;
            return 0;
        }
    }
#else
    (void)limit;
#endif
    if (varint(p, pos, end, &v, 0))
        return -1;
    *out = (int64_t)v;
    return 0;
}

/* The packed varints of [pos, pos + n) appended at out -> their count, or -1 if malformed. */
static Py_ssize_t packed(const uint8_t *p, Py_ssize_t pos, Py_ssize_t n, Py_ssize_t limit,
                         int64_t *out) {
    Py_ssize_t end = pos + n, count = 0;
    while (pos < end)
        if (value(p, &pos, end, limit, out + count++))
            return -1;
    return count;
}

/* The values of a run of unpacked fields in [pos, pos + n) (run() checked it: each a one-byte
 * tag, then a varint of at most 10 bytes) appended at out -> their count. */
static Py_ssize_t unpacked(const uint8_t *p, Py_ssize_t pos, Py_ssize_t n, Py_ssize_t limit,
                           int64_t *out) {
    Py_ssize_t end = pos + n, count = 0;
    while (pos < end) {
        pos++; /* the tag */
        if (value(p, &pos, end, limit, out + count++))
            return -1;
    }
    return count;
}

/* A feature's ids or lengths (a packed field, or a run of unpacked ones) appended at out. */
static Py_ssize_t values(const uint8_t *p, Py_ssize_t pos, Py_ssize_t n, Py_ssize_t count,
                         Py_ssize_t limit, int64_t *out) {
    return count < 0 ? packed(p, pos, n, limit, out) : unpacked(p, pos, n, limit, out);
}

/* validate.py's value checks, all passed (see the top of this file). */
static int checked(const uint8_t *dense, Py_ssize_t dense_n, uint64_t b, Py_ssize_t width,
                   Py_ssize_t max_ids, Py_ssize_t nf, const int64_t *ids, const int64_t *per,
                   const int64_t *lengths, const int64_t *entries) {
    if ((uint64_t)dense_n != 4 * b * (uint64_t)width)
        return 0;
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < dense_n; i += 4) { /* an exponent of all ones: inf or nan */
        uint32_t f;
        memcpy(&f, dense + i, 4);
        bad |= (f & 0x7F800000u) == 0x7F800000u;
    }
    int64_t n_ids = 0;
    for (Py_ssize_t k = 0; k < nf; k++) {
        if ((uint64_t)entries[k] != b)
            return 0;
        int64_t sum = 0;
        for (uint64_t i = 0; i < b; i++) {
            int64_t n = *lengths++;
            bad |= n < 0 || n > max_ids;
            sum += n & 0xFFFFFFFF; /* bounded once bad is clear: no overflow to care about */
        }
        bad |= sum != per[k];
        n_ids += per[k];
    }
    for (int64_t i = 0; i < n_ids; i++)
        bad |= ids[i] < 0;
    return !bad;
}

static PyObject *utf8(const uint8_t *s, Py_ssize_t n) {
    return PyUnicode_DecodeUTF8((const char *)s, n, NULL); /* strict, as str(b, "utf-8") */
}

static int append_name(PyObject *names, const uint8_t *s, Py_ssize_t n) {
    PyObject *name = utf8(s, n);
    int err = !name || PyList_Append(names, name);
    Py_XDECREF(name);
    return err ? -1 : 0;
}

typedef struct {
    Feature *fs;
    Py_ssize_t nf, cap, dense, dense_n, version, version_n;
    Py_ssize_t ids_slots, lengths_slots; /* int64s to hold them: varints at most (bytes, runs) */
    uint64_t b;
    int seen_version;
} Walk;

/* The top level of [0, end) and each feature's structure, into w -> 0: canonical, 1: not,
 * 2: too many features (w->nf of them walked), -1: out of memory. No Python API (the caller
 * may release the GIL): names and model_version are left as offsets. */
static int walk(const uint8_t *p, Py_ssize_t end, Py_ssize_t max_features, Walk *w) {
    Py_ssize_t pos = 0;
    int seen_b = 0, seen_dense = 0;
    while (pos < end) {
        uint8_t tag = p[pos++];
        if (tag == NUM_EXAMPLES && !seen_b) {
            if (varint(p, &pos, end, &w->b, 1) || w->b >= ((uint64_t)1 << 32))
                return 1;
            seen_b = 1;
            continue;
        }
        Py_ssize_t n;
        if (span(p, &pos, end, &n))
            return 1;
        if (tag == SPARSE) {
            if (max_features >= 0 && w->nf >= max_features + 1)
                return 2;
            if (w->nf == w->cap) {
                Feature *more = PyMem_RawRealloc(w->fs, 2 * w->cap * sizeof(Feature));
                if (!more)
                    return -1;
                w->fs = more;
                w->cap *= 2;
            }
            Feature *f = &w->fs[w->nf];
            if (feature(p, pos, pos + n, f))
                return 1;
            w->ids_slots += f->ids_count < 0 ? f->ids_n : f->ids_count;
            w->lengths_slots += f->lengths_count < 0 ? f->lengths_n : f->lengths_count;
            w->nf++;
        } else if (tag == DENSE && !seen_dense && n % 4 == 0) {
            w->dense = pos;
            w->dense_n = n;
            seen_dense = 1;
        } else if (tag == MODEL_VERSION && !w->seen_version) {
            w->version = pos;
            w->version_n = n;
            w->seen_version = 1;
        } else {
            return 1;
        }
        pos += n;
    }
    return 0;
}

static PyObject *columns(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t max_features, dense_width = -1, max_ids = -1;
    if (!PyArg_ParseTuple(args, "y*n|nn", &view, &max_features, &dense_width, &max_ids))
        return NULL;
    const uint8_t *p = view.buf;
    Py_ssize_t end = view.len;
    Walk w = {0};
    PyObject *result = Py_None, *names = NULL, *ids = NULL, *per = NULL, *lengths = NULL,
             *entries = NULL, *v = NULL;
    w.cap = 32;
    w.fs = PyMem_RawMalloc(w.cap * sizeof(Feature));
    if (!w.fs) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    Py_INCREF(Py_None);
    int status;
    if (end > RELEASE_WALK) { /* unpacked runs make the walk as long as the bytes */
        Py_BEGIN_ALLOW_THREADS status = walk(p, end, max_features, &w);
        Py_END_ALLOW_THREADS
    } else {
        status = walk(p, end, max_features, &w);
    }
    if (status < 0) {
        PyErr_NoMemory();
        goto fail;
    }
    if (status == 1)
        goto done;
    /* names and model_version as they came before the walk stopped: not UTF-8 = not canonical */
    if (!(names = PyList_New(0)))
        goto fail;
    for (Py_ssize_t k = 0; k < w.nf; k++)
        if (append_name(names, p + w.fs[k].name, w.fs[k].name_n))
            goto fail_or_none;
    if (w.seen_version ? !(v = utf8(p + w.version, w.version_n))
                       : !(v = PyUnicode_FromStringAndSize(NULL, 0)))
        goto fail_or_none;
    if (status == 2) {
        Py_SETREF(result, PyLong_FromSsize_t(w.nf + 1));
        goto done;
    }
    /* the structure is canonical: now the varints */
    Py_ssize_t nf = w.nf;
    ids = PyBytes_FromStringAndSize(NULL, 8 * w.ids_slots);
    per = PyBytes_FromStringAndSize(NULL, 8 * nf);
    lengths = PyBytes_FromStringAndSize(NULL, 8 * w.lengths_slots);
    entries = PyBytes_FromStringAndSize(NULL, 8 * nf);
    if (!ids || !per || !lengths || !entries)
        goto fail;
    int64_t *id_out = (int64_t *)PyBytes_AS_STRING(ids), *len_out =
                                                            (int64_t *)PyBytes_AS_STRING(lengths);
    int64_t *per_out = (int64_t *)PyBytes_AS_STRING(per), *ent_out =
                                                              (int64_t *)PyBytes_AS_STRING(entries);
    Py_ssize_t n_ids = 0, n_lengths = 0, k = 0;
    /* a large request's varints decode without the GIL: the gateway's event loop runs on while
     * an offload thread decodes (only buffers of ours and the caller's held view are touched) */
    PyThreadState *released =
        w.ids_slots + w.lengths_slots > RELEASE_GIL ? PyEval_SaveThread() : NULL;
    for (; k < nf; k++) {
        const Feature *f = &w.fs[k];
        Py_ssize_t got = values(p, f->ids, f->ids_n, f->ids_count, end, id_out + n_ids);
        Py_ssize_t got_lengths =
            values(p, f->lengths, f->lengths_n, f->lengths_count, end, len_out + n_lengths);
        if (got < 0 || got_lengths < 0)
            break;
        per_out[k] = got;
        ent_out[k] = got_lengths;
        n_ids += got;
        n_lengths += got_lengths;
    }
    if (released)
        PyEval_RestoreThread(released);
    if (k < nf) /* a field that does not end on a complete varint, or one over 10 bytes */
        goto done;
    int clean = dense_width >= 0 && max_ids >= 0 &&
                checked(p + w.dense, w.dense_n, w.b, dense_width, max_ids, nf, id_out, per_out,
                        len_out, ent_out);
    /* sized by bytes (a varint is one at least): cut to the values decoded, which may move
     * them (id_out and len_out are stale from here) */
    if (_PyBytes_Resize(&ids, 8 * n_ids) || _PyBytes_Resize(&lengths, 8 * n_lengths))
        goto fail;
    Py_SETREF(result, Py_BuildValue("(KnnOOOOOOO)", (unsigned long long)w.b, w.dense, w.dense_n,
                                    v, names, ids, per, lengths, entries,
                                    clean ? Py_True : Py_False));
    goto done;
fail_or_none: /* bytes that are not UTF-8 are not canonical (protobuf names them); else fail */
    if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        goto done;
    }
fail:
    Py_SETREF(result, NULL);
done:
    Py_XDECREF(v);
    Py_XDECREF(names);
    Py_XDECREF(ids);
    Py_XDECREF(per);
    Py_XDECREF(lengths);
    Py_XDECREF(entries);
    PyMem_RawFree(w.fs);
    PyBuffer_Release(&view);
    return result;
}

/* --- impressions: the feature log's JSON lines (serving/gateway/featurelog.py's twin) -------
 *
 *   impressions(head, mid, dense f32[B*D], values i64[N], lengths i32[F*B], scores f32[B]) ->
 *     (bytes, [odd example indices])
 *
 * One line per example: head, its index, mid, its score (%.9g: round-trips a float32; null
 * when not finite), then `, "row": "<39 Criteo fields, tabs escaped>"}` and a newline: what
 * recsys_stack/online.py's criteo_row writes, byte for byte. An example no row can hold (a
 * dense value that is not an integer below 2^63 in size, a feature with two ids or a negative
 * one) is left out and its index returned: the caller writes it with dense and sparse arrays.
 * head and mid are the caller's JSON (request id, event time, model, version); the work is
 * done without the GIL, so the gateway's event loop runs on while the log's thread formats. */

static char *put_u64(char *o, uint64_t v) {
    char tmp[20];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *o++ = tmp[--n];
    return o;
}

static char *put_hex(char *o, uint64_t v) {
    static const char digits[] = "0123456789abcdef";
    char tmp[16];
    int n = 0;
    do {
        tmp[n++] = digits[v & 15];
        v >>= 4;
    } while (v);
    while (n)
        *o++ = tmp[--n];
    return o;
}

static const char ROW[] = ", \"row\": \"", END[] = "\"}\n", TAB[] = "\\t";

/* one example's line at o (room checked by the caller) -> its end, or NULL: no row holds it */
static char *impression(char *o, const Py_buffer *head, const Py_buffer *mid, Py_ssize_t b,
                        const float *dense, Py_ssize_t d_n, const int64_t *ids, int64_t *pos,
                        const int32_t *lengths, Py_ssize_t f_n, Py_ssize_t b_n, float score) {
    int odd = 0;
    for (Py_ssize_t f = 0; f < f_n; f++) { /* every feature's cursor moves, odd or not */
        int32_t n = lengths[f * b_n + b];
        if (n > 1 || (n == 1 && ids[pos[f]] < 0))
            odd = 1;
        pos[f] += n;
    }
    for (Py_ssize_t d = 0; d < d_n && !odd; d++) {
        float v = dense[b * d_n + d];
        odd = !isfinite(v) || v != floorf(v) || fabsf(v) >= 9.2e18f;
    }
    if (odd)
        return NULL;
    memcpy(o, head->buf, head->len);
    o = put_u64(o + head->len, (uint64_t)b);
    memcpy(o, mid->buf, mid->len);
    o += mid->len;
    o += isfinite(score) ? snprintf(o, 32, "%.9g", (double)score) : snprintf(o, 32, "null");
    memcpy(o, ROW, sizeof ROW - 1);
    o += sizeof ROW - 1;
    for (Py_ssize_t d = 0; d < d_n; d++) {
        int64_t v = (int64_t)dense[b * d_n + d];
        if (v < 0)
            *o++ = '-';
        o = put_u64(o, v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v);
        memcpy(o, TAB, 2);
        o += 2;
    }
    for (Py_ssize_t f = 0; f < f_n; f++) {
        int32_t n = lengths[f * b_n + b];
        if (n == 1)
            o = put_hex(o, (uint64_t)ids[pos[f] - 1]);
        if (f + 1 < f_n) {
            memcpy(o, TAB, 2);
            o += 2;
        }
    }
    if (f_n == 0 && d_n > 0)
        o -= 2; /* no trailing tab */
    memcpy(o, END, sizeof END - 1);
    return o + sizeof END - 1;
}

static PyObject *impressions(PyObject *self, PyObject *args) {
    Py_buffer head, mid, dense, ids, lengths, scores;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*", &head, &mid, &dense, &ids, &lengths, &scores))
        return NULL;
    PyObject *out = NULL, *odd_list = NULL, *result = NULL;
    int64_t *pos = NULL;
    Py_ssize_t *odd = NULL;
    Py_ssize_t b_n = scores.len / 4, n_ids = ids.len / 8;
    Py_ssize_t d_n = b_n ? dense.len / 4 / b_n : 0, f_n = b_n ? lengths.len / 4 / b_n : 0;
    if (scores.len % 4 || ids.len % 8 || (b_n && (dense.len != 4 * b_n * d_n ||
                                                  lengths.len != 4 * b_n * f_n))) {
        PyErr_SetString(PyExc_ValueError, "impressions: arrays of mismatched sizes");
        goto done;
    }
    const int32_t *len = (const int32_t *)lengths.buf;
    pos = PyMem_RawCalloc(f_n + 1, sizeof *pos);
    odd = PyMem_RawMalloc((b_n + 1) * sizeof *odd);
    if (!pos || !odd) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t total = 0;
    for (Py_ssize_t f = 0; f < f_n; f++) { /* each feature's first id; the ids must all exist */
        pos[f] = total;
        for (Py_ssize_t b = 0; b < b_n; b++) {
            if (len[f * b_n + b] < 0) {
                PyErr_SetString(PyExc_ValueError, "impressions: a negative length");
                goto done;
            }
            total += len[f * b_n + b];
        }
    }
    if (total != n_ids) {
        PyErr_SetString(PyExc_ValueError, "impressions: lengths do not add up to the ids");
        goto done;
    }
    Py_ssize_t line = head.len + mid.len + 20 + 32 + (Py_ssize_t)sizeof ROW + 22 * d_n +
                      18 * f_n + (Py_ssize_t)sizeof END;
    out = PyBytes_FromStringAndSize(NULL, line * b_n);
    if (!out)
        goto done;
    char *o = PyBytes_AS_STRING(out);
    Py_ssize_t n_odd = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t b = 0; b < b_n; b++) {
        char *end = impression(o, &head, &mid, b, (const float *)dense.buf, d_n,
                               (const int64_t *)ids.buf, pos, len, f_n, b_n,
                               ((const float *)scores.buf)[b]);
        if (end)
            o = end;
        else
            odd[n_odd++] = b;
    }
    Py_END_ALLOW_THREADS;
    if (_PyBytes_Resize(&out, o - PyBytes_AS_STRING(out)))
        goto done;
    if (!(odd_list = PyList_New(n_odd)))
        goto done;
    for (Py_ssize_t k = 0; k < n_odd; k++) {
        PyObject *i = PyLong_FromSsize_t(odd[k]);
        if (!i)
            goto done;
        PyList_SET_ITEM(odd_list, k, i);
    }
    result = PyTuple_Pack(2, out, odd_list);
done:
    Py_XDECREF(out);
    Py_XDECREF(odd_list);
    PyMem_RawFree(pos);
    PyMem_RawFree(odd);
    PyBuffer_Release(&head);
    PyBuffer_Release(&mid);
    PyBuffer_Release(&dense);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&scores);
    return result;
}

static PyMethodDef methods[] = {
    {"columns", columns, METH_VARARGS,
     "columns(buf, max_features) -> None | int | tuple: a canonical ScoreRequest's columns."},
    {"impressions", impressions, METH_VARARGS,
     "impressions(head, mid, dense, values, lengths, scores) -> (bytes, [odd examples])."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastwire",
    "A canonically encoded ScoreRequest -> its columns (serving/gateway/wire.py's native twin);"
    " scored examples -> the feature log's lines (serving/gateway/featurelog.py's).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastwire(void) { return PyModule_Create(&module); }
