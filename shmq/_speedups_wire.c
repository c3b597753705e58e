/* shmq/_speedups_wire.c: a consumer's messages straight from the bytes of an answer.
 *
 * wire_records(out, cls, prefix, body, max_records) -> int | None
 *
 * The compiled twin of ``commands._messages(q, gi, group, records_columns(type, body))``
 * for a DELIVER_BATCH or READ_OK body, which is one ``records`` field
 * (codec_bodies.py, drawn in docs/protocol.md):
 *
 *     u32 count n | u64 offsets[n] | u16 deliveries[n] | u64 timestamps[n]
 *                 | u32 meta_lens[n] | u32 payload_lens[n] | meta0 payload0 meta1 payload1 ...
 *
 * every integer big-endian.  Appends ``cls((*prefix, offset, deliveries, payload,
 * metadata, timestamp_ns))`` to ``out`` for each record, in order, and returns n.
 * ``cls`` is a tuple subclass (api.Message).  A body the twin would refuse (shorter than
 * its columns or its bytes, bytes past its end, more than ``max_records``) appends
 * nothing and returns None: the caller then runs the twin, which raises its
 * ProtocolError.
 */
#include "_speedups.h"

static inline uint64_t
be64(const unsigned char *p)
{
    uint64_t x;
    memcpy(&x, p, 8);
    return BE64(x);
}

static inline uint32_t
be32(const unsigned char *p)
{
    uint32_t x;
    memcpy(&x, p, 4);
    return BE32(x);
}

PyObject *
sp_wire_records(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "wire_records(out, cls, prefix, body, max_records)");
        return NULL;
    }
    PyObject *out = args[0], *cls = args[1], *prefix = args[2];
    if (!PyList_Check(out) || !PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)
            || !PyTuple_Check(prefix)) {
        PyErr_SetString(PyExc_TypeError, "wire_records: out must be a list, cls a tuple type, prefix a tuple");
        return NULL;
    }
    Py_ssize_t max_records = PyLong_AsSsize_t(args[4]);
    if (max_records == -1 && PyErr_Occurred())
        return NULL;
    if (max_records < 0) {  /* (as a cast it would allow any count) */
        PyErr_SetString(PyExc_ValueError, "wire_records: max_records must be >= 0");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[3], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *b = (const unsigned char *)view.buf;
    uint64_t len = (uint64_t)view.len;
    PyObject *result = NULL, *empty = NULL;
    if (len < 4)
        goto refuse;
    uint64_t n = be32(b);
    if (n > (uint64_t)max_records || 4 + 26 * n > len)
        goto refuse;
    const unsigned char *offs = b + 4, *dcs = offs + 8 * n, *stamps = dcs + 2 * n;
    const unsigned char *mlens = stamps + 8 * n, *plens = mlens + 4 * n;
    uint64_t pos = 4 + 26 * n;
    for (uint64_t i = 0; i < n; i++)  /* every record's bytes inside the body, and nothing after */
        pos += (uint64_t)be32(mlens + 4 * i) + be32(plens + 4 * i);
    if (pos != len)
        goto refuse;
    empty = PyBytes_FromStringAndSize(NULL, 0);
    if (empty == NULL)
        goto done;
    PyTypeObject *type = (PyTypeObject *)cls;
    pos = 4 + 26 * n;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t mlen = be32(mlens + 4 * i), plen = be32(plens + 4 * i);
        PyObject *meta;
        if (mlen) {
            meta = PyBytes_FromStringAndSize((const char *)b + pos, (Py_ssize_t)mlen);
        }
        else {
            meta = empty;
            Py_INCREF(meta);
        }
        PyObject *payload = PyBytes_FromStringAndSize((const char *)b + pos + mlen, (Py_ssize_t)plen);
        pos += mlen + plen;
        const unsigned char *d = dcs + 2 * i;
        if (sp_append_message(out, type, prefix, PyLong_FromUnsignedLongLong(be64(offs + 8 * i)),
                              PyLong_FromLong((d[0] << 8) | d[1]), payload, meta,
                              PyLong_FromUnsignedLongLong(be64(stamps + 8 * i))) < 0)
            goto done;
    }
    result = PyLong_FromUnsignedLongLong(n);
    goto done;
refuse:
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(empty);
    PyBuffer_Release(&view);
    return result;
}
