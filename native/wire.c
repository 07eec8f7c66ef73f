/* The runtime's per-message work in one call each way (monarch_kernel.runtime.wire._wire).
 *
 * seal(): msgpack-encode a Header, HMAC-SHA256 it with the body (the same coverage as
 * runtime/wire/auth.py), and pack the MAC, the header and the small body frames into one first
 * frame (runtime/wire/framing.py's layout).  open(): the reverse, with every check of
 * Signer.verify in the same order and with the same drop reasons; the MAC is compared in
 * constant time before anything is handed back, and nothing here ever unpickles.
 * The wire format is exactly the pure-Python path's, so the two interoperate.
 *
 * recv()/send() move one first frame through the libzmq that pyzmq loaded (bind_libzmq()
 * finds its functions; sockets are pyzmq's, by their ``underlying`` address): a bytes
 * object and its more-flag in one call, where pyzmq needs a receive and an option read.
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#define MAC_LEN 32
#define HEAD_LEN 6 /* <IH>: header length, number of inlined body frames */
#define INLINE_MAX (1 << 16)
#define BULK (1 << 20)
#define MAX_HEADER (64 * 1024)
#define NFIELDS 14
#define MAX_DEPTH 32
#define CACHE_MAX 512

static const char *FIELD_NAMES[NFIELDS] = {
    "kind", "call_id", "origin", "reply_to", "mesh", "actor", "method",
    "ranks", "fanout", "mode", "resend", "hop", "parts", "payload"};
static PyObject *fields[NFIELDS];
static PyObject *payload_cache; /* bytes(kind, raw payload) -> decoded payload */
static PyObject *empty_tuple;

/* ------------------------------------------------------------------ keys */

typedef struct {
    PyObject_HEAD
    SHA256_CTX inner, outer; /* the padded key's blocks, hashed once */
} KeysObject;

static int Keys_init(KeysObject *self, PyObject *args, PyObject *kw) {
    Py_buffer key;
    if (!PyArg_ParseTuple(args, "y*", &key)) return -1;
    unsigned char pad[64], ipad[64], opad[64];
    memset(pad, 0, 64);
    if (key.len > 64)
        SHA256(key.buf, (size_t)key.len, pad);
    else
        memcpy(pad, key.buf, (size_t)key.len);
    PyBuffer_Release(&key);
    for (int i = 0; i < 64; i++) {
        ipad[i] = pad[i] ^ 0x36;
        opad[i] = pad[i] ^ 0x5c;
    }
    SHA256_Init(&self->inner);
    SHA256_Update(&self->inner, ipad, 64);
    SHA256_Init(&self->outer);
    SHA256_Update(&self->outer, opad, 64);
    return 0;
}

static PyTypeObject KeysType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "monarch_kernel.runtime.wire._wire.Keys",
    .tp_basicsize = sizeof(KeysObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "HMAC-SHA256 states of one job key: Keys(key)",
    .tp_init = (initproc)Keys_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ buffers */

typedef struct {
    const unsigned char *p;
    Py_ssize_t n;
} Seg;

typedef struct {
    char *p;
    Py_ssize_t n, cap;
} Out;

static int out_room(Out *o, Py_ssize_t k) {
    if (o->n + k <= o->cap) return 0;
    Py_ssize_t cap = o->cap ? o->cap : 256;
    while (cap < o->n + k) cap *= 2;
    char *p = PyMem_Realloc(o->p, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->p = p;
    o->cap = cap;
    return 0;
}

static int out_put(Out *o, const void *src, Py_ssize_t k) {
    if (out_room(o, k) < 0) return -1;
    memcpy(o->p + o->n, src, (size_t)k);
    o->n += k;
    return 0;
}

static int out_be(Out *o, unsigned char tag, uint64_t v, int bytes) {
    unsigned char b[9];
    b[0] = tag;
    for (int i = 0; i < bytes; i++) b[1 + i] = (unsigned char)(v >> (8 * (bytes - 1 - i)));
    return out_put(o, b, 1 + bytes);
}

static void put_le(unsigned char *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static uint64_t get_be(const unsigned char *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v = (v << 8) | p[i];
    return v;
}

/* ------------------------------------------------------------------ msgpack: encoding */

static int pack_len(Out *o, Py_ssize_t n, unsigned char fix, int fixmax, unsigned char t8,
                    unsigned char t16, unsigned char t32) {
    if (n <= fixmax) {
        unsigned char b = (unsigned char)(fix | n);
        return out_put(o, &b, 1);
    }
    if (t8 && n < 256) return out_be(o, t8, (uint64_t)n, 1);
    if (n < 65536) return out_be(o, t16, (uint64_t)n, 2);
    if ((uint64_t)n < ((uint64_t)1 << 32)) return out_be(o, t32, (uint64_t)n, 4);
    PyErr_SetString(PyExc_ValueError, "too large to pack");
    return -1;
}

static int pack_obj(Out *o, PyObject *v, int depth) {
    if (depth > MAX_DEPTH) {
        PyErr_SetString(PyExc_ValueError, "nested too deeply to pack");
        return -1;
    }
    if (v == Py_None) return out_put(o, "\xc0", 1);
    if (v == Py_True) return out_put(o, "\xc3", 1);
    if (v == Py_False) return out_put(o, "\xc2", 1);
    if (PyLong_Check(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow > 0) {
            unsigned long long u = PyLong_AsUnsignedLongLong(v);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
            return out_be(o, 0xcf, u, 8);
        }
        if (overflow < 0) {
            PyErr_SetString(PyExc_OverflowError, "integer out of range to pack");
            return -1;
        }
        if (x == -1 && PyErr_Occurred()) return -1;
        if (x >= 0) {
            if (x < 128) {
                unsigned char b = (unsigned char)x;
                return out_put(o, &b, 1);
            }
            if (x < 256) return out_be(o, 0xcc, (uint64_t)x, 1);
            if (x < 65536) return out_be(o, 0xcd, (uint64_t)x, 2);
            if (x < 4294967296LL) return out_be(o, 0xce, (uint64_t)x, 4);
            return out_be(o, 0xcf, (uint64_t)x, 8);
        }
        if (x >= -32) {
            unsigned char b = (unsigned char)(x & 0xff);
            return out_put(o, &b, 1);
        }
        if (x >= -128) return out_be(o, 0xd0, (uint64_t)x & 0xff, 1);
        if (x >= -32768) return out_be(o, 0xd1, (uint64_t)x & 0xffff, 2);
        if (x >= -2147483648LL) return out_be(o, 0xd2, (uint64_t)x & 0xffffffffULL, 4);
        return out_be(o, 0xd3, (uint64_t)x, 8);
    }
    if (PyUnicode_Check(v)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(v, &n);
        if (s == NULL) return -1;
        if (pack_len(o, n, 0xa0, 31, 0xd9, 0xda, 0xdb) < 0) return -1;
        return out_put(o, s, n);
    }
    if (PyList_Check(v) || PyTuple_Check(v)) {
        PyObject *seq = v;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (pack_len(o, n, 0x90, 15, 0, 0xdc, 0xdd) < 0) return -1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (pack_obj(o, PySequence_Fast_GET_ITEM(seq, i), depth + 1) < 0) return -1;
        return 0;
    }
    if (PyBytes_Check(v)) {
        Py_ssize_t n = PyBytes_GET_SIZE(v);
        if (pack_len(o, n, 0, -1, 0xc4, 0xc5, 0xc6) < 0) return -1;
        return out_put(o, PyBytes_AS_STRING(v), n);
    }
    if (PyFloat_Check(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        uint64_t u;
        memcpy(&u, &d, 8);
        return out_be(o, 0xcb, u, 8);
    }
    if (PyDict_Check(v)) {
        Py_ssize_t pos = 0;
        PyObject *k, *x;
        if (pack_len(o, PyDict_GET_SIZE(v), 0x80, 15, 0, 0xde, 0xdf) < 0) return -1;
        while (PyDict_Next(v, &pos, &k, &x))
            if (pack_obj(o, k, depth + 1) < 0 || pack_obj(o, x, depth + 1) < 0) return -1;
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "can not serialize %.100s object in a header", Py_TYPE(v)->tp_name);
    return -1;
}

/* ------------------------------------------------------------------ msgpack: decoding */

typedef struct {
    const unsigned char *p;
    Py_ssize_t at, n;
} In;

/* NULL with no exception set: malformed. */
static PyObject *unpack_obj(In *in, int depth);

static int need(In *in, Py_ssize_t k) { return in->n - in->at >= k; }

static PyObject *unpack_seq(In *in, Py_ssize_t n, int is_map, int depth) {
    if (depth > MAX_DEPTH || n > in->n - in->at) return NULL; /* each item is at least a byte */
    if (is_map) {
        PyObject *d = PyDict_New();
        if (d == NULL) return NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *k = unpack_obj(in, depth + 1);
            if (k == NULL || !(PyUnicode_CheckExact(k) || PyBytes_CheckExact(k))) {
                Py_XDECREF(k);
                Py_DECREF(d);
                return NULL;
            }
            PyObject *v = unpack_obj(in, depth + 1);
            if (v == NULL || PyDict_SetItem(d, k, v) < 0) {
                Py_DECREF(k);
                Py_XDECREF(v);
                Py_DECREF(d);
                return NULL;
            }
            Py_DECREF(k);
            Py_DECREF(v);
        }
        return d;
    }
    PyObject *l = PyList_New(n);
    if (l == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = unpack_obj(in, depth + 1);
        if (v == NULL) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, i, v);
    }
    return l;
}

static PyObject *unpack_raw(In *in, Py_ssize_t n, int is_str) {
    if (!need(in, n)) return NULL;
    const char *s = (const char *)in->p + in->at;
    in->at += n;
    if (!is_str) return PyBytes_FromStringAndSize(s, n);
    PyObject *u = PyUnicode_DecodeUTF8(s, n, "strict");
    if (u == NULL) PyErr_Clear();
    return u;
}

static PyObject *unpack_obj(In *in, int depth) {
    if (!need(in, 1)) return NULL;
    unsigned char t = in->p[in->at++];
    if (t <= 0x7f) return PyLong_FromLong(t);
    if (t >= 0xe0) return PyLong_FromLong((long)(signed char)t);
    if (t >= 0xa0 && t <= 0xbf) return unpack_raw(in, t & 0x1f, 1);
    if (t >= 0x90 && t <= 0x9f) return unpack_seq(in, t & 0x0f, 0, depth);
    if (t >= 0x80 && t <= 0x8f) return unpack_seq(in, t & 0x0f, 1, depth);
    int k;
    switch (t) {
    case 0xc0: Py_RETURN_NONE;
    case 0xc2: Py_RETURN_FALSE;
    case 0xc3: Py_RETURN_TRUE;
    case 0xc4: case 0xc5: case 0xc6:
    case 0xd9: case 0xda: case 0xdb: {
        k = (t == 0xc4 || t == 0xd9) ? 1 : (t == 0xc5 || t == 0xda) ? 2 : 4;
        if (!need(in, k)) return NULL;
        Py_ssize_t n = (Py_ssize_t)get_be(in->p + in->at, k);
        in->at += k;
        return unpack_raw(in, n, t >= 0xd9);
    }
    case 0xdc: case 0xdd: case 0xde: case 0xdf: {
        k = (t == 0xdc || t == 0xde) ? 2 : 4;
        if (!need(in, k)) return NULL;
        Py_ssize_t n = (Py_ssize_t)get_be(in->p + in->at, k);
        in->at += k;
        return unpack_seq(in, n, t >= 0xde, depth);
    }
    case 0xca: case 0xcb: {
        k = t == 0xca ? 4 : 8;
        if (!need(in, k)) return NULL;
        uint64_t u = get_be(in->p + in->at, k);
        in->at += k;
        if (k == 4) {
            uint32_t w = (uint32_t)u;
            float f;
            memcpy(&f, &w, 4);
            return PyFloat_FromDouble(f);
        }
        double d;
        memcpy(&d, &u, 8);
        return PyFloat_FromDouble(d);
    }
    case 0xcc: case 0xcd: case 0xce: case 0xcf: {
        k = 1 << (t - 0xcc);
        if (!need(in, k)) return NULL;
        uint64_t u = get_be(in->p + in->at, k);
        in->at += k;
        return PyLong_FromUnsignedLongLong(u);
    }
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        k = 1 << (t - 0xd0);
        if (!need(in, k)) return NULL;
        uint64_t u = get_be(in->p + in->at, k);
        in->at += k;
        int64_t x = k == 1 ? (int8_t)u : k == 2 ? (int16_t)u : k == 4 ? (int32_t)u : (int64_t)u;
        return PyLong_FromLongLong(x);
    }
    default:
        return NULL; /* 0xc1 and the ext types: never in a header we wrote */
    }
}

/* ------------------------------------------------------------------ the MAC */

/* HMAC over the header, the lengths of all body frames (<Q each), each part's pickle and
 * its buffers under BULK bytes.  nbufs: per part; the layout must fit the body. */
static void mac_of(KeysObject *k, const unsigned char *hb, Py_ssize_t hlen, Seg *body, Py_ssize_t nbody,
                   const Py_ssize_t *nbufs, Py_ssize_t nparts, unsigned char out[MAC_LEN]) {
    SHA256_CTX c = k->inner;
    SHA256_Update(&c, hb, (size_t)hlen);
    unsigned char lens[8 * 64];
    for (Py_ssize_t i = 0; i < nbody;) {
        Py_ssize_t m = nbody - i < 64 ? nbody - i : 64;
        for (Py_ssize_t j = 0; j < m; j++) put_le(lens + 8 * j, (uint64_t)body[i + j].n, 8);
        SHA256_Update(&c, lens, (size_t)(8 * m));
        i += m;
    }
    Py_ssize_t i = 0;
    for (Py_ssize_t p = 0; p < nparts; p++) {
        SHA256_Update(&c, body[i].p, (size_t)body[i].n);
        for (Py_ssize_t j = i + 1; j < i + 1 + nbufs[p]; j++)
            if (body[j].n < BULK) SHA256_Update(&c, body[j].p, (size_t)body[j].n);
        i += 1 + nbufs[p];
    }
    unsigned char inner[MAC_LEN];
    SHA256_Final(inner, &c);
    c = k->outer;
    SHA256_Update(&c, inner, MAC_LEN);
    SHA256_Final(out, &c);
}

/* ------------------------------------------------------------------ seal */

static PyObject *wire_seal(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyObject_TypeCheck(args[0], &KeysType) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "seal(keys, header, body: list)");
        return NULL;
    }
    KeysObject *keys = (KeysObject *)args[0];
    PyObject *header = args[1], *body = args[2], *result = NULL, *parts = NULL;
    Py_ssize_t nbody = PyList_GET_SIZE(body), got = 0, nparts = 0;
    Out o = {0};
    Py_buffer *views = PyMem_Calloc((size_t)(nbody ? nbody : 1), sizeof(Py_buffer));
    Seg *segs = PyMem_Calloc((size_t)(nbody ? nbody : 1), sizeof(Seg));
    Py_ssize_t *nbufs = NULL;
    if (views == NULL || segs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (out_put(&o, "\x9e", 1) < 0) goto done; /* an array of the 14 fields */
    for (int i = 0; i < NFIELDS; i++) {
        PyObject *v = PyObject_GetAttr(header, fields[i]);
        if (v == NULL) goto done;
        int rc = pack_obj(&o, v, 0);
        if (i == 12 && rc == 0) {
            parts = v; /* kept for the layout */
        } else {
            Py_DECREF(v);
        }
        if (rc < 0) goto done;
    }
    if (!PyList_Check(parts)) {
        PyErr_SetString(PyExc_TypeError, "header.parts must be a list");
        goto done;
    }
    nparts = PyList_GET_SIZE(parts);
    nbufs = PyMem_Calloc((size_t)(nparts ? nparts : 1), sizeof(Py_ssize_t));
    if (nbufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t want = 0;
    for (Py_ssize_t p = 0; p < nparts; p++) {
        PyObject *e = PyList_GET_ITEM(parts, p);
        if (!(PyList_Check(e) || PyTuple_Check(e)) || PySequence_Fast_GET_SIZE(e) != 3) {
            PyErr_SetString(PyExc_ValueError, "header.parts: [rank, status, nbufs] per part");
            goto done;
        }
        nbufs[p] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(e, 2));
        if (nbufs[p] == -1 && PyErr_Occurred()) goto done;
        if (nbufs[p] < 0) {
            PyErr_SetString(PyExc_ValueError, "header.parts: a negative buffer count");
            goto done;
        }
        want += 1 + nbufs[p];
    }
    if (want > nbody) {
        PyErr_SetString(PyExc_IndexError, "the header's part layout names more frames than the body has");
        goto done;
    }
    for (; got < nbody; got++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(body, got), &views[got], PyBUF_SIMPLE) < 0) goto done;
        segs[got].p = views[got].buf;
        segs[got].n = views[got].len;
    }
    Py_ssize_t ninline = 0, total = 0;
    while (ninline < nbody && ninline < 65535) {
        Py_ssize_t n = segs[ninline].n;
        if (n >= INLINE_MAX || total + n > INLINE_MAX) break;
        total += n;
        ninline++;
    }
    unsigned char mac[MAC_LEN];
    mac_of(keys, (unsigned char *)o.p, o.n, segs, nbody, nbufs, nparts, mac);
    PyObject *first = PyBytes_FromStringAndSize(NULL, MAC_LEN + HEAD_LEN + 4 * ninline + o.n + total);
    if (first == NULL) goto done;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(first);
    memcpy(w, mac, MAC_LEN);
    w += MAC_LEN;
    put_le(w, (uint64_t)o.n, 4);
    put_le(w + 4, (uint64_t)ninline, 2);
    w += HEAD_LEN;
    for (Py_ssize_t i = 0; i < ninline; i++, w += 4) put_le(w, (uint64_t)segs[i].n, 4);
    memcpy(w, o.p, (size_t)o.n);
    w += o.n;
    for (Py_ssize_t i = 0; i < ninline; i++) {
        memcpy(w, segs[i].p, (size_t)segs[i].n);
        w += segs[i].n;
    }
    result = PyList_New(1 + nbody - ninline);
    if (result == NULL) {
        Py_DECREF(first);
        goto done;
    }
    PyList_SET_ITEM(result, 0, first);
    for (Py_ssize_t i = ninline; i < nbody; i++) {
        PyObject *f = PyList_GET_ITEM(body, i);
        Py_INCREF(f);
        PyList_SET_ITEM(result, 1 + i - ninline, f);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(segs);
    PyMem_Free(nbufs);
    PyMem_Free(o.p);
    Py_XDECREF(parts);
    return result;
}

/* ------------------------------------------------------------------ open */

typedef struct {
    PyObject *header_cls, *decode_payload, *keyring;
    KeysObject *keys;
    Py_ssize_t max_frame, max_frames;
} Checks;

/* The decoded Header, or NULL with no exception set when malformed. */
static PyObject *decode_header(Checks *ck, const unsigned char *hb, Py_ssize_t hlen) {
    In in = {hb, 0, hlen};
    if (hlen < 1 || hb[0] != 0x9e) {
        /* Not the fixarray of 14 we write: only a longer array form can still be right. */
        if (!(hlen >= 3 && hb[0] == 0xdc && hb[1] == 0 && hb[2] == NFIELDS) &&
            !(hlen >= 5 && hb[0] == 0xdd && get_be(hb + 1, 4) == NFIELDS))
            return NULL;
        in.at = hb[0] == 0xdc ? 3 : 5;
    } else {
        in.at = 1;
    }
    PyObject *values[NFIELDS] = {0};
    PyObject *h = NULL;
    int i;
    for (i = 0; i < NFIELDS - 1; i++) {
        values[i] = unpack_obj(&in, 1);
        if (values[i] == NULL) goto fail;
    }
    /* The payload: the rest of the header.  A kind's payloads repeat (a mesh's slice), so
     * the decoded value of the same bytes is reused. */
    PyObject *raw_kind = values[0];
    if (!PyLong_Check(raw_kind) || in.at >= hlen) goto fail;
    Py_ssize_t off = in.at;
    if (hb[off] == 0xc0) {
        if (off + 1 != hlen) goto fail;
        values[i] = Py_None;
        Py_INCREF(Py_None);
    } else {
        long kind = PyLong_AsLong(raw_kind);
        if (kind == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto fail;
        }
        PyObject *key = PyBytes_FromStringAndSize(NULL, 8 + hlen - off);
        if (key == NULL) goto fail;
        put_le((unsigned char *)PyBytes_AS_STRING(key), (uint64_t)kind, 8);
        memcpy(PyBytes_AS_STRING(key) + 8, hb + off, (size_t)(hlen - off));
        PyObject *hit = PyDict_GetItemWithError(payload_cache, key);
        if (hit != NULL) {
            values[i] = hit;
            Py_INCREF(hit);
            Py_DECREF(key);
        } else {
            PyObject *rawp = unpack_obj(&in, 1);
            if (rawp == NULL || in.at != hlen) {
                Py_XDECREF(rawp);
                Py_DECREF(key);
                goto fail;
            }
            PyObject *call[2] = {raw_kind, rawp};
            values[i] = PyObject_Vectorcall(ck->decode_payload, call, 2, NULL);
            Py_DECREF(rawp);
            if (values[i] == NULL) {
                Py_DECREF(key);
                if (PyErr_ExceptionMatches(PyExc_ValueError)) PyErr_Clear();
                goto fail;
            }
            if (PyDict_GET_SIZE(payload_cache) >= CACHE_MAX) PyDict_Clear(payload_cache);
            if (PyDict_SetItem(payload_cache, key, values[i]) < 0) {
                Py_DECREF(key);
                goto fail;
            }
            Py_DECREF(key);
        }
    }
    in.at = hlen;
    /* The Header without running its (Python) __init__: the fields set one by one. */
    PyTypeObject *cls = (PyTypeObject *)ck->header_cls;
    h = cls->tp_new(cls, empty_tuple, NULL);
    for (int j = 0; h != NULL && j < NFIELDS; j++)
        if (PyObject_SetAttr(h, fields[j], values[j]) < 0) Py_CLEAR(h);
fail:
    for (int j = 0; j < NFIELDS; j++) Py_XDECREF(values[j]);
    return h;
}

/* Which counter a message that fails a check increments, as a str (Dropped's reason). */
static PyObject *dropped(const char *reason) { return PyUnicode_FromString(reason); }

static PyObject *wire_open(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyObject_TypeCheck(args[0], &KeysType) || !PyList_Check(args[2]) || !PyType_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "open(keys, keyring, frames: list, header_cls, decode_payload, max_frame, max_frames)");
        return NULL;
    }
    Checks ck = {args[3], args[4], args[1], (KeysObject *)args[0], PyLong_AsSsize_t(args[5]),
                 PyLong_AsSsize_t(args[6])};
    if (PyErr_Occurred()) return NULL;
    PyObject *frames = args[2], *result = NULL, *h = NULL, *bodyl = NULL;
    Py_ssize_t nf = PyList_GET_SIZE(frames), got = 0;
    if (nf < 1) return dropped("unsigned");
    Py_buffer *views = PyMem_Calloc((size_t)nf, sizeof(Py_buffer));
    Seg *segs = NULL;
    Py_ssize_t *nbufs = NULL;
    if (views == NULL) return PyErr_NoMemory();
    for (; got < nf; got++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(frames, got), &views[got], PyBUF_SIMPLE) < 0) goto done;
    const unsigned char *first = views[0].buf;
    Py_ssize_t flen = views[0].len, ninline = 0, nlog;
    int packed = flen > MAC_LEN;
    if (packed) {
        if (flen < MAC_LEN + HEAD_LEN) {
            result = dropped("malformed");
            goto done;
        }
        Py_ssize_t hl = (Py_ssize_t)get_le(first + MAC_LEN, 4);
        ninline = (Py_ssize_t)get_le(first + MAC_LEN + 4, 2);
        Py_ssize_t at = MAC_LEN + HEAD_LEN;
        if (flen < at + 4 * ninline) {
            result = dropped("malformed");
            goto done;
        }
        int64_t end = at + 4 * ninline + hl;
        for (Py_ssize_t i = 0; i < ninline; i++) end += (int64_t)get_le(first + at + 4 * i, 4);
        if (end != flen) {
            result = dropped(end > flen ? "truncated" : "malformed");
            goto done;
        }
        nlog = 2 + ninline + (nf - 1);
        segs = PyMem_Calloc((size_t)nlog, sizeof(Seg));
        if (segs == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        segs[0].p = first;
        segs[0].n = MAC_LEN;
        Py_ssize_t w = at + 4 * ninline;
        segs[1].p = first + w;
        segs[1].n = hl;
        w += hl;
        for (Py_ssize_t i = 0; i < ninline; i++) {
            segs[2 + i].p = first + w;
            segs[2 + i].n = (Py_ssize_t)get_le(first + at + 4 * i, 4);
            w += segs[2 + i].n;
        }
        for (Py_ssize_t i = 1; i < nf; i++) {
            segs[1 + ninline + i].p = views[i].buf;
            segs[1 + ninline + i].n = views[i].len;
        }
    } else {
        nlog = nf;
        segs = PyMem_Calloc((size_t)nlog, sizeof(Seg));
        if (segs == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < nf; i++) {
            segs[i].p = views[i].buf;
            segs[i].n = views[i].len;
        }
    }
    if (nlog < 2) {
        result = dropped("unsigned");
        goto done;
    }
    if (nlog > ck.max_frames) {
        result = dropped("oversized");
        goto done;
    }
    if (segs[0].n != MAC_LEN) {
        result = dropped("unsigned");
        goto done;
    }
    Seg *body = segs + 2;
    Py_ssize_t nbody = nlog - 2;
    if (segs[1].n > MAX_HEADER) {
        result = dropped("oversized");
        goto done;
    }
    for (Py_ssize_t i = 0; i < nbody; i++)
        if (body[i].n > ck.max_frame) {
            result = dropped("oversized");
            goto done;
        }
    h = decode_header(&ck, segs[1].p, segs[1].n);
    if (h == NULL) {
        if (!PyErr_Occurred()) result = dropped("malformed");
        goto done;
    }
    /* The routing fields' types, and the part layout. */
    PyObject *kind = PyObject_GetAttr(h, fields[0]);
    PyObject *parts = kind ? PyObject_GetAttr(h, fields[12]) : NULL;
    int ok = kind != NULL && parts != NULL && PyLong_Check(kind) && PyList_Check(parts);
    Py_ssize_t nparts = ok ? PyList_GET_SIZE(parts) : 0, count = 0;
    nbufs = PyMem_Calloc((size_t)(nparts ? nparts : 1), sizeof(Py_ssize_t));
    if (nbufs == NULL) ok = 0;
    for (Py_ssize_t p = 0; ok && p < nparts; p++) {
        PyObject *e = PyList_GET_ITEM(parts, p);
        if (!PyList_Check(e) || PyList_GET_SIZE(e) != 3) {
            ok = 0;
            break;
        }
        for (int j = 0; j < 3; j++)
            if (!PyLong_Check(PyList_GET_ITEM(e, j))) ok = 0;
        if (!ok) break;
        int overflow = 0;
        long long nb = PyLong_AsLongLongAndOverflow(PyList_GET_ITEM(e, 2), &overflow);
        if (overflow < 0 || nb < 0) {
            ok = 0;
            break;
        }
        if (overflow > 0 || nb > nbody) {
            nb = nbody + 1; /* more than the body has: truncated, below */
        }
        nbufs[p] = (Py_ssize_t)nb;
        if (count <= nbody) count += 1 + nbufs[p];
    }
    Py_XDECREF(kind);
    Py_XDECREF(parts);
    if (PyErr_Occurred()) goto done;
    if (!ok) {
        result = dropped("malformed");
        goto done;
    }
    if (count != nbody) {
        result = dropped("truncated");
        goto done;
    }
    KeysObject *keys = ck.keys;
    if (ck.keyring != Py_None && PyDict_GET_SIZE(ck.keyring)) {
        PyObject *mesh = PyObject_GetAttr(h, fields[4]);
        if (mesh == NULL) goto done;
        PyObject *other = PyDict_GetItemWithError(ck.keyring, mesh);
        Py_DECREF(mesh);
        if (other == NULL && PyErr_Occurred()) goto done;
        if (other != NULL && PyObject_TypeCheck(other, &KeysType)) keys = (KeysObject *)other;
    }
    unsigned char mac[MAC_LEN];
    mac_of(keys, segs[1].p, segs[1].n, body, nbody, nbufs, nparts, mac);
    if (CRYPTO_memcmp(mac, segs[0].p, MAC_LEN) != 0) {
        result = dropped("forged");
        goto done;
    }
    bodyl = PyList_New(nbody);
    if (bodyl == NULL) goto done;
    for (Py_ssize_t i = 0; i < nbody; i++) {
        PyObject *f;
        if (packed && i < ninline) {
            f = PyBytes_FromStringAndSize((const char *)body[i].p, body[i].n);
            if (f == NULL) goto done;
        } else {
            f = PyList_GET_ITEM(frames, packed ? 1 + i - ninline : 2 + i);
            Py_INCREF(f);
        }
        PyList_SET_ITEM(bodyl, i, f);
    }
    result = PyTuple_Pack(2, h, bodyl);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(segs);
    PyMem_Free(nbufs);
    Py_XDECREF(h);
    Py_XDECREF(bodyl);
    return result;
}


/* ------------------------------------------------------------------ libzmq, directly */

typedef struct {
    unsigned char _[64];
} __attribute__((aligned(8))) zmsg_t;

static int (*z_msg_init)(zmsg_t *);
static int (*z_msg_recv)(zmsg_t *, void *, int);
static void *(*z_msg_data)(zmsg_t *);
static size_t (*z_msg_size)(const zmsg_t *);
static int (*z_msg_more)(const zmsg_t *);
static int (*z_msg_close)(zmsg_t *);
static int (*z_send)(void *, const void *, size_t, int);
static int (*z_errno)(void);
static const char *(*z_strerror)(int);
static PyObject *zmq_error; /* zmq.ZMQError */

static PyObject *wire_bind_libzmq(PyObject *mod, PyObject *args) {
    const char *path;
    PyObject *err;
    if (!PyArg_ParseTuple(args, "sO", &path, &err)) return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL) {
        PyErr_Format(PyExc_OSError, "libzmq is not loaded from %s: %s", path, dlerror());
        return NULL;
    }
#define SYM(var, name)                                                          \
    *(void **)(&var) = dlsym(h, name);                                          \
    if (var == NULL) {                                                          \
        PyErr_Format(PyExc_OSError, "%s has no %s", path, name);                \
        return NULL;                                                            \
    }
    SYM(z_msg_init, "zmq_msg_init");
    SYM(z_msg_recv, "zmq_msg_recv");
    SYM(z_msg_data, "zmq_msg_data");
    SYM(z_msg_size, "zmq_msg_size");
    SYM(z_msg_more, "zmq_msg_more");
    SYM(z_msg_close, "zmq_msg_close");
    SYM(z_send, "zmq_send");
    SYM(z_errno, "zmq_errno");
    SYM(z_strerror, "zmq_strerror");
#undef SYM
    Py_XDECREF(zmq_error);
    Py_INCREF(err);
    zmq_error = err;
    Py_RETURN_NONE;
}

static PyObject *raise_zmq(int e) {
    PyObject *exc = PyObject_CallFunction(zmq_error, "i", e);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static void *socket_ptr(PyObject *o) {
    void *p = PyLong_AsVoidPtr(o);
    if (p == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a closed socket");
    return p;
}

/* recv(socket address, flags) -> (first frame as bytes, more) or None (EAGAIN: nothing, or
 * the receive timed out).  A blocking receive lets go of the GIL. */
static PyObject *wire_recv(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || z_msg_recv == NULL) {
        PyErr_SetString(PyExc_TypeError, "recv(socket address, flags) after bind_libzmq()");
        return NULL;
    }
    void *sock = socket_ptr(args[0]);
    int flags = PyLong_AsLong(args[1]);
    if (sock == NULL || PyErr_Occurred()) return NULL;
    zmsg_t msg;
    z_msg_init(&msg);
    int rc;
    for (;;) {
        if (flags & 1) {
            rc = z_msg_recv(&msg, sock, flags);
        } else {
            Py_BEGIN_ALLOW_THREADS
            rc = z_msg_recv(&msg, sock, flags);
            Py_END_ALLOW_THREADS
        }
        if (rc >= 0) break;
        int e = z_errno();
        if (e == EINTR) {
            if (PyErr_CheckSignals() < 0) {
                z_msg_close(&msg);
                return NULL;
            }
            continue;
        }
        z_msg_close(&msg);
        if (e == EAGAIN) Py_RETURN_NONE;
        return raise_zmq(e);
    }
    PyObject *data = PyBytes_FromStringAndSize(z_msg_data(&msg), (Py_ssize_t)z_msg_size(&msg));
    int more = z_msg_more(&msg);
    z_msg_close(&msg);
    if (data == NULL) return NULL;
    PyObject *out = PyTuple_New(2);
    if (out == NULL) {
        Py_DECREF(data);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, data);
    PyTuple_SET_ITEM(out, 1, PyBool_FromLong(more));
    return out;
}

/* send(socket address, data, flags) -> True, or False when the peer's queue is full
 * (EAGAIN, with ZMQ_DONTWAIT); the data is copied.  Never blocks. */
static PyObject *wire_send(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || z_send == NULL) {
        PyErr_SetString(PyExc_TypeError, "send(socket address, data, flags) after bind_libzmq()");
        return NULL;
    }
    void *sock = socket_ptr(args[0]);
    int flags = PyLong_AsLong(args[2]);
    if (sock == NULL || PyErr_Occurred()) return NULL;
    if (!(flags & 1)) {
        PyErr_SetString(PyExc_ValueError, "send() only sends without waiting (ZMQ_DONTWAIT)");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[1], &b, PyBUF_SIMPLE) < 0) return NULL;
    int rc;
    for (;;) {
        rc = z_send(sock, b.buf, (size_t)b.len, flags);
        if (rc >= 0) break;
        int e = z_errno();
        if (e == EINTR) {
            if (PyErr_CheckSignals() < 0) {
                PyBuffer_Release(&b);
                return NULL;
            }
            continue;
        }
        PyBuffer_Release(&b);
        if (e == EAGAIN) Py_RETURN_FALSE;
        return raise_zmq(e);
    }
    PyBuffer_Release(&b);
    Py_RETURN_TRUE;
}

static PyObject *wire_clear_cache(PyObject *mod, PyObject *unused) {
    PyDict_Clear(payload_cache);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"seal", (PyCFunction)(void (*)(void))wire_seal, METH_FASTCALL,
     "seal(keys, header, body) -> [first frame, large frames...]: encode, sign and pack one message"},
    {"open", (PyCFunction)(void (*)(void))wire_open, METH_FASTCALL,
     "open(keys, keyring, frames, header_cls, decode_payload, max_frame, max_frames) -> (header, body) "
     "of an authentic message, or the drop reason (str)"},
    {"clear_cache", wire_clear_cache, METH_NOARGS, "forget the decoded payloads kept for reuse"},
    {"bind_libzmq", wire_bind_libzmq, METH_VARARGS,
     "bind_libzmq(path, ZMQError): use the functions of the libzmq loaded from path"},
    {"recv", (PyCFunction)(void (*)(void))wire_recv, METH_FASTCALL,
     "recv(socket address, flags) -> (first frame, more) or None when nothing came"},
    {"send", (PyCFunction)(void (*)(void))wire_send, METH_FASTCALL,
     "send(socket address, data, flags) -> False when the queue is full"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef wiremodule = {PyModuleDef_HEAD_INIT, "_wire",
                                        "The runtime's per-message envelope work in C (see native/wire.c).", -1,
                                        methods};

PyMODINIT_FUNC PyInit__wire(void) {
    if (PyType_Ready(&KeysType) < 0) return NULL;
    for (int i = 0; i < NFIELDS; i++) {
        fields[i] = PyUnicode_InternFromString(FIELD_NAMES[i]);
        if (fields[i] == NULL) return NULL;
    }
    payload_cache = PyDict_New();
    empty_tuple = PyTuple_New(0);
    if (payload_cache == NULL || empty_tuple == NULL) return NULL;
    PyObject *m = PyModule_Create(&wiremodule);
    if (m == NULL) return NULL;
    Py_INCREF(&KeysType);
    if (PyModule_AddObject(m, "Keys", (PyObject *)&KeysType) < 0) {
        Py_DECREF(&KeysType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
