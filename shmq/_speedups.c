/* shmq._speedups: the optional compiled accelerator of the co-located hot paths.
 *
 * Every function here has a pure-Python twin (shmq.accel names them) and does exactly
 * what the twin does, or returns None where the twin would raise or where the input is
 * unusual (the caller then runs the twin, which raises the same typed error as ever).
 *
 * Nothing in this file writes shared memory: the lock functions call the same libc
 * functions the ctypes path calls (pthread_mutex_trylock / pthread_mutex_unlock on a
 * robust, process-shared mutex), and ``records`` only reads published slots and record
 * bytes under the consumer lock the caller holds.  The one-message put, get and ack
 * (shmq/_speedups_one.c) do write it, under the caller's lock, with the same stores as
 * their twins in the same order: the crash-safety protocol (layout.py: one aligned 8-byte
 * store commits what was written before it) is kept.
 */
#include "_speedups.h"
#include <pthread.h>

/* ------------------------------------------------------------------ locks */

/* The mutex at the address ``addr`` (an int), or NULL with an exception set. */
static pthread_mutex_t *
mutex_at(PyObject *addr)
{
    void *p = PyLong_AsVoidPtr(addr);
    if (p == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "null mutex address");
    return (pthread_mutex_t *)p;
}

static PyObject *
sp_trylock(PyObject *mod, PyObject *addr)
{
    pthread_mutex_t *m = mutex_at(addr);
    return m == NULL ? NULL : PyLong_FromLong(pthread_mutex_trylock(m));
}

static PyObject *
sp_unlock(PyObject *mod, PyObject *addr)
{
    pthread_mutex_t *m = mutex_at(addr);
    return m == NULL ? NULL : PyLong_FromLong(pthread_mutex_unlock(m));
}

/* ------------------------------------------------------------------ headers
 * The header block (shmq.headers, big-endian):
 *   tag u8 = 0x01 | count u16 | count x (key length u16, key UTF-8, value length u16, value)
 */

#define HEADER_TAG 0x01
#define SHORT_LEN 256

/* encode_headers(headers, max_headers, max_bytes) -> bytes | None
 * None for anything but a dict of non-empty str keys to str / bytes values within the
 * limits (the pure-Python encoder then raises, or handles the rarer types). */
static PyObject *
sp_encode_headers(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "encode_headers(headers, max_headers, max_bytes)");
        return NULL;
    }
    PyObject *h = args[0];
    Py_ssize_t max_headers = PyLong_AsSsize_t(args[1]);
    Py_ssize_t max_bytes = PyLong_AsSsize_t(args[2]);
    if ((max_headers == -1 || max_bytes == -1) && PyErr_Occurred())
        return NULL;
    if (!PyDict_CheckExact(h))
        Py_RETURN_NONE;
    Py_ssize_t count = PyDict_GET_SIZE(h);
    if (count == 0)
        return PyBytes_FromStringAndSize(NULL, 0);
    if (count > max_headers || count > 0xFFFF)
        Py_RETURN_NONE;
    Py_ssize_t total = 3, pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(h, &pos, &k, &v)) {
        Py_ssize_t kn, vn;
        if (!PyUnicode_CheckExact(k))
            Py_RETURN_NONE;
        if (PyUnicode_AsUTF8AndSize(k, &kn) == NULL) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (kn == 0)
            Py_RETURN_NONE;
        if (PyBytes_CheckExact(v))
            vn = PyBytes_GET_SIZE(v);
        else if (PyUnicode_CheckExact(v)) {
            if (PyUnicode_AsUTF8AndSize(v, &vn) == NULL) {
                PyErr_Clear();
                Py_RETURN_NONE;
            }
        }
        else
            Py_RETURN_NONE;
        if (kn > 0xFFFF || vn > 0xFFFF)
            Py_RETURN_NONE;
        total += 4 + kn + vn;
        if (total > max_bytes)
            Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        return NULL;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    *o++ = HEADER_TAG;
    *o++ = (unsigned char)(count >> 8);
    *o++ = (unsigned char)count;
    pos = 0;
    while (PyDict_Next(h, &pos, &k, &v)) {
        Py_ssize_t kn, vn;
        const char *ks = PyUnicode_AsUTF8AndSize(k, &kn);  /* cached by the first pass */
        const char *vs;
        if (PyBytes_CheckExact(v)) {
            vs = PyBytes_AS_STRING(v);
            vn = PyBytes_GET_SIZE(v);
        }
        else
            vs = PyUnicode_AsUTF8AndSize(v, &vn);
        if (ks == NULL || vs == NULL) {  /* cannot happen: the first pass encoded both */
            Py_DECREF(out);
            return NULL;
        }
        *o++ = (unsigned char)(kn >> 8);
        *o++ = (unsigned char)kn;
        memcpy(o, ks, kn);
        o += kn;
        *o++ = (unsigned char)(vn >> 8);
        *o++ = (unsigned char)vn;
        memcpy(o, vs, vn);
        o += vn;
    }
    return out;
}

/* A small cache of header keys: the same few keys come with message after message, so
 * a key seen lately is reused (no decode, its hash kept) instead of made again.  Direct
 * mapped by a hash of the key's bytes; only ASCII keys of up to KEY_CACHE_LEN bytes are
 * kept (their UTF-8 is their 1-byte data, compared with memcmp). */
#define KEY_CACHE 64
#define KEY_CACHE_LEN 64
static PyObject *key_cache[KEY_CACHE];

/* The str of the UTF-8 key b[0:kn] (kn > 0), a new reference; NULL on an error (a
 * UnicodeDecodeError for bytes that are not UTF-8). */
static PyObject *
header_key(const unsigned char *b, Py_ssize_t kn)
{
    if (kn > KEY_CACHE_LEN)
        return PyUnicode_DecodeUTF8((const char *)b, kn, "strict");
    uint32_t h = 2166136261u;  /* FNV-1a */
    unsigned char high = 0;
    for (Py_ssize_t i = 0; i < kn; i++) {
        h = (h ^ b[i]) * 16777619u;
        high |= b[i];
    }
    if (high & 0x80)  /* not ASCII: not cached */
        return PyUnicode_DecodeUTF8((const char *)b, kn, "strict");
    PyObject **slot = &key_cache[(h ^ (h >> 16)) & (KEY_CACHE - 1)];
    PyObject *k = *slot;
    if (k != NULL && PyUnicode_GET_LENGTH(k) == kn && memcmp(PyUnicode_1BYTE_DATA(k), b, kn) == 0)
        return Py_NewRef(k);
    k = PyUnicode_DecodeUTF8((const char *)b, kn, "strict");  /* ASCII: a compact 1-byte str */
    if (k == NULL || PyObject_Hash(k) == -1) {  /* (hashed once, here: the hash stays with it) */
        Py_XDECREF(k);
        return NULL;
    }
    Py_XSETREF(*slot, Py_NewRef(k));
    return k;
}

/* The headers of the block at the start of b[0:n] as a new dict, its length in *end;
 * Py_None (a new reference) when the block is malformed, NULL on an error. */
static PyObject *
parse_block(const unsigned char *b, Py_ssize_t n, Py_ssize_t *end)
{
    Py_ssize_t at = 3;
    PyObject *d = NULL, *result = NULL;
    if (n < 3 || b[0] != HEADER_TAG)
        goto malformed;
    Py_ssize_t count = (b[1] << 8) | b[2];
    d = PyDict_New();
    if (d == NULL)
        goto error;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (at + 2 > n)
            goto malformed;
        Py_ssize_t kn = (b[at] << 8) | b[at + 1];
        at += 2;
        if (kn == 0 || at + kn + 2 > n)
            goto malformed;
        PyObject *key = header_key(b + at, kn);
        if (key == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                goto error;
            PyErr_Clear();
            goto malformed;
        }
        at += kn;
        Py_ssize_t vn = (b[at] << 8) | b[at + 1];
        at += 2;
        if (at + vn > n) {
            Py_DECREF(key);
            goto malformed;
        }
        PyObject *value = PyBytes_FromStringAndSize((const char *)b + at, vn);
        if (value == NULL) {
            Py_DECREF(key);
            goto error;
        }
        at += vn;
        int rc = PyDict_SetItem(d, key, value);
        Py_DECREF(key);
        Py_DECREF(value);
        if (rc < 0)
            goto error;
    }
    if (PyDict_GET_SIZE(d) != count)  /* a key repeated */
        goto malformed;
    *end = at;
    return d;
malformed:
    result = Py_None;
    Py_INCREF(result);
error:
    Py_XDECREF(d);
    return result;
}

/* parse_headers(meta) -> (dict, block length) | None
 * None when the block is malformed (the pure-Python parser then raises InvalidArgument). */
static PyObject *
sp_parse_headers(PyObject *mod, PyObject *meta)
{
    Py_buffer view;
    Py_ssize_t end = 0;
    if (PyObject_GetBuffer(meta, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *d = parse_block((const unsigned char *)view.buf, view.len, &end);
    PyBuffer_Release(&view);
    if (d == NULL || d == Py_None)
        return d;
    return Py_BuildValue("(Nn)", d, end);
}

/* decode_headers(meta, empty) -> mappingproxy | None
 * ``headers.decode``: ``empty`` when meta holds no header block (empty, or not starting
 * with the tag), a read-only view of the headers, or None when the block is malformed. */
static PyObject *
sp_decode_headers(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "decode_headers(meta, empty)");
        return NULL;
    }
    Py_buffer view;
    Py_ssize_t end = 0;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *b = (const unsigned char *)view.buf;
    if (view.len == 0 || b[0] != HEADER_TAG) {
        PyBuffer_Release(&view);
        Py_INCREF(args[1]);
        return args[1];
    }
    PyObject *d = parse_block(b, view.len, &end);
    PyBuffer_Release(&view);
    if (d == NULL || d == Py_None)
        return d;
    PyObject *proxy = PyDictProxy_New(d);
    Py_DECREF(d);
    return proxy;
}

/* ------------------------------------------------------------------ delivered records
 * records(out, cls, prefix, w, mm, b0, sw, k, offset, data_off, size) -> None
 *
 * Appends ``cls((*prefix, offset + i, 1, payload, metadata, timestamp_ns))`` to ``out``
 * for the k slots whose head starts at word b0 + i * sw of ``mm`` (S_OFFSET, S_BYTEPOS,
 * S_LENS, S_TIMESTAMP: layout.py), the record at data_off + bytepos % size:
 * ``metadata || payload``, their lengths in S_LENS (payload low 32 bits, metadata high).
 * ``cls`` is a tuple subclass (api.Message).  Slices are clamped to the mapping as
 * Python's slicing clamps them.  ``w`` (the words of ``mm``, which the pure-Python twin
 * reads) is not used here.
 */

int
sp_append_message(PyObject *out, PyTypeObject *type, PyObject *prefix, PyObject *off, PyObject *dc,
                  PyObject *payload, PyObject *meta, PyObject *stamp)
{
    Py_ssize_t np = PyTuple_GET_SIZE(prefix);
    PyObject *t = NULL;
    if (off != NULL && dc != NULL && payload != NULL && meta != NULL && stamp != NULL)
        t = type->tp_alloc(type, np + 5);
    if (t == NULL) {
        Py_XDECREF(off);
        Py_XDECREF(dc);
        Py_XDECREF(payload);
        Py_XDECREF(meta);
        Py_XDECREF(stamp);
        return -1;
    }
    for (Py_ssize_t j = 0; j < np; j++) {
        PyObject *x = PyTuple_GET_ITEM(prefix, j);
        Py_INCREF(x);
        PyTuple_SET_ITEM(t, j, x);
    }
    PyTuple_SET_ITEM(t, np, off);
    PyTuple_SET_ITEM(t, np + 1, dc);
    PyTuple_SET_ITEM(t, np + 2, payload);
    PyTuple_SET_ITEM(t, np + 3, meta);
    PyTuple_SET_ITEM(t, np + 4, stamp);
    int rc = PyList_Append(out, t);
    Py_DECREF(t);
    return rc;
}

PyObject *
sp_slice_bytes(const char *buf, Py_ssize_t len, Py_ssize_t a, Py_ssize_t b)
{
    if (a > len)
        a = len;
    if (b > len)
        b = len;
    if (b < a)
        b = a;
    return PyBytes_FromStringAndSize(buf + a, b - a);
}

static PyObject *
sp_records(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError,
                        "records(out, cls, prefix, w, mm, b0, sw, k, offset, data_off, size)");
        return NULL;
    }
    PyObject *out = args[0], *cls = args[1], *prefix = args[2], *mm = args[4];
    args += 1;  /* past w */
    if (!PyList_Check(out) || !PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)
            || !PyTuple_Check(prefix)) {
        PyErr_SetString(PyExc_TypeError, "records: out must be a list, cls a tuple type, prefix a tuple");
        return NULL;
    }
    Py_ssize_t b0 = PyLong_AsSsize_t(args[4]);
    Py_ssize_t sw = PyLong_AsSsize_t(args[5]);
    Py_ssize_t k = PyLong_AsSsize_t(args[6]);
    unsigned long long offset = PyLong_AsUnsignedLongLong(args[7]);
    Py_ssize_t data = PyLong_AsSsize_t(args[8]);
    unsigned long long size = PyLong_AsUnsignedLongLong(args[9]);
    if (PyErr_Occurred())
        return NULL;
    if (b0 < 0 || sw < 4 || k < 0 || data < 0 || size == 0) {
        PyErr_SetString(PyExc_ValueError, "records: bad geometry");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(mm, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const char *buf = (const char *)view.buf;
    Py_ssize_t len = view.len;
    if (k && (unsigned long long)(k - 1) > ((unsigned long long)len / 8) / (unsigned long long)sw) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "records: slots past the end of the mapping");
        return NULL;
    }
    if (((unsigned long long)b0 + (k ? (unsigned long long)(k - 1) * sw : 0) + 4) * 8 > (unsigned long long)len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "records: slots past the end of the mapping");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *one = PyLong_FromLong(1);
    PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
    if (one == NULL || empty == NULL)
        goto error;
    for (Py_ssize_t i = 0; i < k; i++) {
        const uint64_t *slot = (const uint64_t *)(buf + (b0 + i * sw) * 8);
        /* one aligned 8-byte load per word, as memoryview.cast("Q") reads them */
        uint64_t pos = ((volatile const uint64_t *)slot)[S_BYTEPOS];
        uint64_t lens = ((volatile const uint64_t *)slot)[S_LENS];
        uint64_t ts = ((volatile const uint64_t *)slot)[S_TIMESTAMP];
        uint64_t start = (uint64_t)data + pos % size;
        uint64_t mlen = lens >> 32, plen = lens & 0xFFFFFFFFull;
        PyObject *payload, *meta, *off, *stamp;
        if ((uint64_t)len < start || start + mlen + plen > (uint64_t)PY_SSIZE_T_MAX)
            start = (uint64_t)len, mlen = plen = 0;  /* out of the mapping: clamped to nothing */
        if (mlen) {
            payload = sp_slice_bytes(buf, len, (Py_ssize_t)(start + mlen), (Py_ssize_t)(start + mlen + plen));
            meta = payload ? sp_slice_bytes(buf, len, (Py_ssize_t)start, (Py_ssize_t)(start + mlen)) : NULL;
        }
        else {
            payload = sp_slice_bytes(buf, len, (Py_ssize_t)start, (Py_ssize_t)(start + plen));
            meta = empty;
            Py_INCREF(meta);
        }
        off = PyLong_FromUnsignedLongLong(offset + (uint64_t)i);
        stamp = PyLong_FromUnsignedLongLong(ts);
        Py_INCREF(one);
        if (sp_append_message(out, type, prefix, off, one, payload, meta, stamp) < 0)
            goto error;
    }
    Py_DECREF(one);
    Py_DECREF(empty);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
error:
    Py_XDECREF(one);
    Py_XDECREF(empty);
    PyBuffer_Release(&view);
    return NULL;
}

/* ------------------------------------------------------------------ a read's run
 * read_run(mm, slots_w, cap, sw, data_off, size, start, n, max_bytes, field)
 *     -> (stamps, meta_lens, payload_lens, data) | bytes
 * The compiled twin of the copy in rawread.read_columns, under the consumer lock its
 * caller holds (which keeps the records from being freed): the records start .. start +
 * n - 1, fewer where their bytes would pass max_bytes (at least one).  With field 0 the
 * columns come as native-order bytes (u64 timestamps, u32 lengths) and the records'
 * metadata and payload back to back in data; with field 1, as one READ_OK ``records``
 * field (codec_bodies.records_field: a u32 count, big-endian columns of offsets,
 * deliveries (0), timestamps, metadata and payload lengths, then the bytes).  It only
 * reads shared memory; a slot whose record would reach past the byte ring (a corrupt
 * slot) is a ValueError. */

static PyObject *
sp_read_run(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "read_run(mm, slots_w, cap, sw, data_off, size, start, n, max_bytes, field)");
        return NULL;
    }
    Py_ssize_t sl = PyLong_AsSsize_t(args[1]);
    unsigned long long cap = PyLong_AsUnsignedLongLong(args[2]);
    Py_ssize_t sw = PyLong_AsSsize_t(args[3]);
    Py_ssize_t data_off = PyLong_AsSsize_t(args[4]);
    unsigned long long size = PyLong_AsUnsignedLongLong(args[5]);
    unsigned long long start = PyLong_AsUnsignedLongLong(args[6]);
    Py_ssize_t n = PyLong_AsSsize_t(args[7]);
    unsigned long long max_bytes = PyLong_AsUnsignedLongLong(args[8]);
    int field = PyObject_IsTrue(args[9]);
    if (PyErr_Occurred() || field < 0)
        return NULL;
    if (sl < 0 || cap == 0 || sw <= S_TIMESTAMP || data_off < 0 || size == 0 || n < 1 || n > 0xFFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "read_run: bad geometry");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *cols[4] = {NULL, NULL, NULL, NULL}, *out = NULL;
    const char *mm = (const char *)view.buf;
    const volatile uint64_t *w = (const volatile uint64_t *)view.buf;
    if ((unsigned long long)sw > (unsigned long long)(view.len / 8) / cap
            || (unsigned long long)sl + cap * (unsigned long long)sw > (unsigned long long)(view.len / 8)
            || (unsigned long long)data_off + size > (unsigned long long)view.len) {
        PyErr_SetString(PyExc_ValueError, "read_run: geometry past the end of the mapping");
        goto done;
    }
    /* how many fit max_bytes (at least one), and their bytes; every one checked to lie in
     * the byte ring before anything is allocated (a corrupt length must not ask for GiBs) */
    unsigned long long total = 0;
    Py_ssize_t k = 0;
    for (; k < n; k++) {
        Py_ssize_t b = sl + (Py_ssize_t)((start + k) % cap) * sw;
        uint64_t lens = w[b + S_LENS];
        unsigned long long len = (lens & 0xFFFFFFFFull) + (lens >> 32);
        if (k && total + len > max_bytes)
            break;
        if (w[b + S_BYTEPOS] % size + len > size) {
            PyErr_Format(PyExc_ValueError, "the record of offset %llu reaches past the byte ring",
                         start + (unsigned long long)k);
            goto done;
        }
        total += len;
    }
    char *st, *ml, *pl, *d;
    if (field) {
        out = PyBytes_FromStringAndSize(NULL, 4 + 26 * k + (Py_ssize_t)total);
        if (!out)
            goto done;
        char *f = PyBytes_AS_STRING(out);
        uint32_t count = BE32((uint32_t)k);
        memcpy(f, &count, 4);
        for (Py_ssize_t i = 0; i < k; i++) {
            uint64_t o = BE64(start + (unsigned long long)i);
            memcpy(f + 4 + 8 * i, &o, 8);
        }
        memset(f + 4 + 8 * k, 0, 2 * k);  /* deliveries: 0 for a read */
        st = f + 4 + 10 * k, ml = f + 4 + 18 * k, pl = f + 4 + 22 * k, d = f + 4 + 26 * k;
    } else {
        cols[0] = PyBytes_FromStringAndSize(NULL, k * 8);
        cols[1] = PyBytes_FromStringAndSize(NULL, k * 4);
        cols[2] = PyBytes_FromStringAndSize(NULL, k * 4);
        cols[3] = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
        if (!cols[0] || !cols[1] || !cols[2] || !cols[3])
            goto done;
        st = PyBytes_AS_STRING(cols[0]), ml = PyBytes_AS_STRING(cols[1]);
        pl = PyBytes_AS_STRING(cols[2]), d = PyBytes_AS_STRING(cols[3]);
    }
    unsigned long long at = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t b = sl + (Py_ssize_t)((start + i) % cap) * sw;
        uint64_t lens = w[b + S_LENS], stamp = w[b + S_TIMESTAMP];
        unsigned long long len = (lens & 0xFFFFFFFFull) + (lens >> 32), pos = w[b + S_BYTEPOS] % size;
        if (pos + len > size || at + len > total) {  /* (rewritten since the look above) */
            PyErr_Format(PyExc_ValueError, "the record of offset %llu reaches past the byte ring",
                         start + (unsigned long long)i);
            Py_CLEAR(out);
            goto done;
        }
        uint32_t p32 = (uint32_t)(lens & 0xFFFFFFFFull), m32 = (uint32_t)(lens >> 32);
        if (field) {
            stamp = BE64(stamp);
            p32 = BE32(p32);
            m32 = BE32(m32);
        }
        memcpy(st + 8 * i, &stamp, 8);
        memcpy(ml + 4 * i, &m32, 4);
        memcpy(pl + 4 * i, &p32, 4);
        memcpy(d + at, mm + data_off + pos, (size_t)len);
        at += len;
    }
    if (!field)
        out = PyTuple_Pack(4, cols[0], cols[1], cols[2], cols[3]);
done:
    for (int i = 0; i < 4; i++)
        Py_XDECREF(cols[i]);
    PyBuffer_Release(&view);
    return out;
}

/* ------------------------------------------------------------------ module */

/* ------------------------------------------------------------------ crash points */

char sp_crash_name[64];
long sp_crash_left;
unsigned long long sp_calls[N_CALLS];

static PyObject *
sp_crash_arm(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    const char *name;
    Py_ssize_t len;
    if (nargs != 2 || (name = PyUnicode_AsUTF8AndSize(args[0], &len)) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "crash_arm(name, count)");
        return NULL;
    }
    long count = PyLong_AsLong(args[1]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    if (len >= (Py_ssize_t)sizeof(sp_crash_name)) {
        PyErr_SetString(PyExc_ValueError, "crash_arm: name too long");
        return NULL;
    }
    sp_crash_name[0] = '\0';  /* (disarmed while it changes) */
    sp_crash_left = count;
    memcpy(sp_crash_name, name, (size_t)len + 1);
    Py_RETURN_NONE;
}

static PyObject *
sp_crash_disarm(PyObject *mod, PyObject *unused)
{
    sp_crash_name[0] = '\0';
    sp_crash_left = 0;
    Py_RETURN_NONE;
}

static PyObject *
sp_crash_hit(PyObject *mod, PyObject *arg)
{
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL)
        return NULL;
    crash_point(name);
    Py_RETURN_NONE;
}

static PyObject *
sp_calls_of(PyObject *mod, PyObject *unused)
{
    static const char *names[N_CALLS] = {"put_one", "deliver_one", "ack_one", "ack_run", "settle_range"};
    PyObject *d = PyDict_New();
    for (int i = 0; d != NULL && i < N_CALLS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sp_calls[i]);
        if (v == NULL || PyDict_SetItemString(d, names[i], v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

static PyMethodDef methods[] = {
    {"crash_arm", (PyCFunction)(void (*)(void))sp_crash_arm, METH_FASTCALL,
     "crash_arm(name, count): die at the count-th pass through the point name, here or in Python."},
    {"crash_disarm", (PyCFunction)sp_crash_disarm, METH_NOARGS, "crash_disarm(): no point is armed."},
    {"crash_hit", (PyCFunction)sp_crash_hit, METH_O,
     "crash_hit(name): a pass through a point of Python's (one count for both)."},
    {"calls", (PyCFunction)sp_calls_of, METH_NOARGS,
     "calls() -> dict: the calls of each function that writes shared memory, in this process."},
    {"trylock", (PyCFunction)sp_trylock, METH_O,
     "trylock(address) -> int: pthread_mutex_trylock on the mutex at address (0: taken)."},
    {"unlock", (PyCFunction)sp_unlock, METH_O,
     "unlock(address) -> int: pthread_mutex_unlock on the mutex at address."},
    {"encode_headers", (PyCFunction)(void (*)(void))sp_encode_headers, METH_FASTCALL,
     "encode_headers(headers, max_headers, max_bytes) -> bytes | None: a dict's header block."},
    {"parse_headers", (PyCFunction)sp_parse_headers, METH_O,
     "parse_headers(meta) -> (dict, length) | None: the header block at the start of meta."},
    {"decode_headers", (PyCFunction)(void (*)(void))sp_decode_headers, METH_FASTCALL,
     "decode_headers(meta, empty) -> mappingproxy | None: the headers a record's metadata holds."},
    {"records", (PyCFunction)(void (*)(void))sp_records, METH_FASTCALL,
     "records(out, cls, prefix, w, mm, b0, sw, k, offset, data_off, size): append k delivered records."},
    {"deliver_one", (PyCFunction)(void (*)(void))sp_deliver_one, METH_FASTCALL,
     "deliver_one(geom, gi, word, now, ref, group) -> Message | None | False: lease the next new message."},
    {"ack_one", (PyCFunction)(void (*)(void))sp_ack_one, METH_FASTCALL,
     "ack_one(geom, ref, offset, dc, lone_gen) -> int: ack one delivery and move the floor."},
    {"put_one", (PyCFunction)(void (*)(void))sp_put_one, METH_FASTCALL,
     "put_one(geom, payload, meta, ts) -> int: append one record (-1: no room now)."},
    {"read_run", (PyCFunction)(void (*)(void))sp_read_run, METH_FASTCALL,
     "read_run(mm, slots_w, cap, sw, data_off, size, start, n, max_bytes, field) -> columns | a records field."},
    {"ack_run", (PyCFunction)(void (*)(void))sp_ack_run, METH_FASTCALL,
     "ack_run(geom, msgs, q, lone_gen) -> int: ack a run of deliveries and move the floor (-1: the twin's)."},
    {"wire_records", (PyCFunction)(void (*)(void))sp_wire_records, METH_FASTCALL,
     "wire_records(out, cls, prefix, body, max_records) -> int | None: a records field's messages."},
    {"settle_range", (PyCFunction)(void (*)(void))sp_settle_range, METH_FASTCALL,
     "settle_range(mm, sl, cap, sw, lw, start, end) -> int: a commit's DONE words (DEADING ones left)."},
    {"take_one", (PyCFunction)(void (*)(void))sp_take_one, METH_FASTCALL,
     "take_one(geom, ref, owner, vis_ms, group, lock, ggen, now) -> Message | None | False | int: trylock, deliver_one, unlock."},
    {"ack_lock", (PyCFunction)(void (*)(void))sp_ack_lock, METH_FASTCALL,
     "ack_lock(geom, ref, offset, dc, lone_gen, lock) -> int: trylock, ack_one, unlock (-errno: not taken)."},
    {"spin_wait", (PyCFunction)(void (*)(void))sp_spin_wait, METH_FASTCALL,
     "spin_wait(geom, gi, window_ns) -> bool: a message past group gi's cursor within the window."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmq._speedups",
    "The optional compiled accelerator of shmq's co-located hot paths (shmq.accel).", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModule_Create(&module);
}
