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
 * max_features < 0: no bound. No numpy here: arrays leave as bytes (np.frombuffer reads them).
 * clean (given dense_width and max_ids >= 0): every value passes validate.py's checks that need
 * no schema names (num_examples x dense_width finite floats, num_examples lengths per feature,
 * each within [0, max_ids], adding up to the feature's ids, no negative id). False says only
 * that validate.py must look; it then names what is wrong, and this module never does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { NUM_EXAMPLES = 0x08, DENSE = 0x12, SPARSE = 0x1A, MODEL_VERSION = 0x22 };
enum { NAME = 0x0A, IDS = 0x12, LENGTHS = 0x1A };
enum { RELEASE_GIL = 16384 }; /* varints (at most) above which the decode releases the GIL */

typedef struct {
    Py_ssize_t name, name_n, ids, ids_n, lengths, lengths_n; /* offsets and sizes in buf */
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

/* One SparseFeature in [pos, end): name, ids, lengths, each at most once and in that order. */
static int feature(const uint8_t *p, Py_ssize_t pos, Py_ssize_t end, Feature *f) {
    static const uint8_t tags[3] = {NAME, IDS, LENGTHS};
    Py_ssize_t *at[3] = {&f->name, &f->ids, &f->lengths}, *size[3] = {&f->name_n, &f->ids_n,
                                                                      &f->lengths_n};
    for (int k = 0; k < 3; k++) {
        *at[k] = pos;
        *size[k] = 0;
        if (pos < end && p[pos] == tags[k]) {
            pos++;
            if (span(p, &pos, end, size[k]))
                return -1;
            *at[k] = pos;
            pos += *size[k];
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

/* The packed varints of [pos, pos + n) appended at out -> their count, or -1 if malformed.
 * Words are read up to limit (the request's end), never past it. */
static Py_ssize_t packed(const uint8_t *p, Py_ssize_t pos, Py_ssize_t n, Py_ssize_t limit,
                         int64_t *out) {
    Py_ssize_t end = pos + n, count = 0;
    (void)limit; /* without WORDS */
    while (pos < end) {
        uint8_t b = p[pos];
        if (b < 0x80) { /* one byte: the common case for lengths and small ids */
            out[count++] = b;
            pos++;
            continue;
        }
        uint64_t v;
#if WORDS
        if (pos + 8 <= limit) {
            int size = word_varint(p + pos, &v);
            if (size) {
                if (pos + size > end)
                    return -1; /* it ends past the field */
                out[count++] = (int64_t)v;
                pos += size;
                continue;
            }
        }
#endif
        if (varint(p, &pos, end, &v, 0))
            return -1;
        out[count++] = (int64_t)v;
    }
    return count;
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

static PyObject *columns(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t max_features, dense_width = -1, max_ids = -1;
    if (!PyArg_ParseTuple(args, "y*n|nn", &view, &max_features, &dense_width, &max_ids))
        return NULL;
    const uint8_t *p = view.buf;
    Py_ssize_t pos = 0, end = view.len, dense = 0, dense_n = 0;
    Py_ssize_t nf = 0, cap = 32, ids_bytes = 0, lengths_bytes = 0; /* bytes: varints at most */
    uint64_t b = 0;
    int seen_b = 0, seen_dense = 0, seen_version = 0;
    PyObject *result = Py_None, *names = NULL, *ids = NULL, *per = NULL, *lengths = NULL,
             *entries = NULL, *v = NULL;
    Feature *fs = PyMem_Malloc(cap * sizeof(Feature));
    if (!fs) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    Py_INCREF(Py_None);
    names = PyList_New(0);
    if (!names)
        goto fail;
    while (pos < end) {
        uint8_t tag = p[pos++];
        if (tag == NUM_EXAMPLES && !seen_b) {
            if (varint(p, &pos, end, &b, 1) || b >= ((uint64_t)1 << 32))
                goto done;
            seen_b = 1;
            continue;
        }
        Py_ssize_t n;
        if (span(p, &pos, end, &n))
            goto done;
        if (tag == SPARSE) {
            if (max_features >= 0 && nf >= max_features + 1) {
                Py_SETREF(result, PyLong_FromSsize_t(nf + 1));
                goto done;
            }
            if (nf == cap) {
                Feature *more = PyMem_Realloc(fs, 2 * cap * sizeof(Feature));
                if (!more) {
                    PyErr_NoMemory();
                    goto fail;
                }
                fs = more;
                cap *= 2;
            }
            if (feature(p, pos, pos + n, &fs[nf]))
                goto done;
            if (append_name(names, p + fs[nf].name, fs[nf].name_n))
                goto fail_or_none;
            ids_bytes += fs[nf].ids_n;
            lengths_bytes += fs[nf].lengths_n;
            nf++;
        } else if (tag == DENSE && !seen_dense && n % 4 == 0) {
            dense = pos;
            dense_n = n;
            seen_dense = 1;
        } else if (tag == MODEL_VERSION && !seen_version) {
            if (!(v = utf8(p + pos, n)))
                goto fail_or_none;
            seen_version = 1;
        } else {
            goto done;
        }
        pos += n;
    }
    /* the structure is canonical: now the varints */
    if (!v && !(v = PyUnicode_FromStringAndSize(NULL, 0)))
        goto fail;
    ids = PyBytes_FromStringAndSize(NULL, 8 * ids_bytes);
    per = PyBytes_FromStringAndSize(NULL, 8 * nf);
    lengths = PyBytes_FromStringAndSize(NULL, 8 * lengths_bytes);
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
    PyThreadState *released = ids_bytes + lengths_bytes > RELEASE_GIL ? PyEval_SaveThread() : NULL;
    for (; k < nf; k++) {
        Py_ssize_t got = packed(p, fs[k].ids, fs[k].ids_n, end, id_out + n_ids);
        Py_ssize_t got_lengths = packed(p, fs[k].lengths, fs[k].lengths_n, end, len_out + n_lengths);
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
                checked(p + dense, dense_n, b, dense_width, max_ids, nf, id_out, per_out, len_out,
                        ent_out);
    /* sized by bytes (a varint is one at least): cut to the values decoded, which may move
     * them (id_out and len_out are stale from here) */
    if (_PyBytes_Resize(&ids, 8 * n_ids) || _PyBytes_Resize(&lengths, 8 * n_lengths))
        goto fail;
    Py_SETREF(result, Py_BuildValue("(KnnOOOOOOO)", (unsigned long long)b, dense, dense_n, v,
                                    names, ids, per, lengths, entries, clean ? Py_True : Py_False));
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
    PyMem_Free(fs);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"columns", columns, METH_VARARGS,
     "columns(buf, max_features) -> None | int | tuple: a canonical ScoreRequest's columns."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastwire",
    "A canonically encoded ScoreRequest -> its columns (serving/gateway/wire.py's native twin).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastwire(void) { return PyModule_Create(&module); }
