/* shmq._speedups, the one-message put, get and ack, a batch's ack and a commit's range
 * (shmq/_speedups.c is the module).
 *
 * The five functions here write shared memory, each under the lock its caller holds: the
 * same aligned 8-byte stores as its pure-Python twin, in the same order, the commit last
 * (shmq/core/layout.py), passing the same crash points between them (crash_point: an armed
 * point kills here as it does in the twin, so the compiled stores are the ones the
 * crash tests prove).  Each returns a sentinel where its twin must decide instead, and
 * writes nothing then. */
#include "_speedups.h"
#include <pthread.h>

#define Q_NEXT_OFFSET 24
#define Q_TAIL_BYTES 25
#define Q_FREE_OFFSET 32
#define Q_GROUP_GEN 35
#define Q_STATE 4
#define QS_ACTIVE 1
#define G_WORDS 32
#define G_CURSOR 1
#define G_FLOOR 2
#define G_REDELIVER 3
#define G_NEXT_EXPIRY 5
#define G_ACKED 7
#define G_SERIAL 22
#define G_DELIVERED 23
#define S_EXPIRES 4
#define S_GROUPS 5
#define GI_BITS 6
#define GI_MASK ((1 << GI_BITS) - 1)
#define LEASED 1
#define READY 2
#define DONE 3
#define DEADING 4
#define STATE_MASK 7
#define DC_SHIFT 3
#define OWNER_SHIFT 11
#define TIME_SHIFT 24

/* CLOCK_MONOTONIC in ns (the clock of time.monotonic_ns, so of handle.monotonic_ms) */
static inline uint64_t
mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A queue's geometry, as its callers bind it once (core.delivery.Delivery.one_geom,
 * ring.Ring._put_geom): (mm, groups_w, slots_w, capacity, slot_words, tail_word, data_off,
 * size, ...), with the mapping's buffer held writable until geom_close. */
typedef struct {
    Py_buffer view;
    volatile uint64_t *w;
    Py_ssize_t nw, gw, sl, sw, tw, data;
    unsigned long long cap, size;
} Geom;

/* Read ``geom`` (a tuple of ``items``) into ``g``: 0, or -1 with an exception set and
 * nothing held when it is malformed or any of its tables reaches past the mapping. */
static int
geom_open(PyObject *geom, Py_ssize_t items, const char *fn, Geom *g)
{
    if (!PyTuple_CheckExact(geom) || PyTuple_GET_SIZE(geom) != items) {
        PyErr_Format(PyExc_TypeError, "%s: geom must be a %zd-tuple", fn, items);
        return -1;
    }
    g->gw = PyLong_AsSsize_t(PyTuple_GET_ITEM(geom, 1));
    g->sl = PyLong_AsSsize_t(PyTuple_GET_ITEM(geom, 2));
    g->cap = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(geom, 3));
    g->sw = PyLong_AsSsize_t(PyTuple_GET_ITEM(geom, 4));
    g->tw = PyLong_AsSsize_t(PyTuple_GET_ITEM(geom, 5));
    g->data = PyLong_AsSsize_t(PyTuple_GET_ITEM(geom, 6));
    g->size = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(geom, 7));
    if (PyErr_Occurred())
        return -1;
    if (g->gw < 0 || g->sl < 0 || g->cap == 0 || g->sw <= S_GROUPS || g->tw < 0 || g->data < 0
            || g->size == 0) {
        PyErr_Format(PyExc_ValueError, "%s: bad geometry", fn);
        return -1;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(geom, 0), &g->view, PyBUF_WRITABLE) < 0)
        return -1;
    g->w = (volatile uint64_t *)g->view.buf;
    g->nw = g->view.len / 8;
    /* in unsigned arithmetic, overflow included: a corrupt capacity (2**64-1, say) must
     * never make a slot's index wrap into the mapping */
    uint64_t nw = (uint64_t)g->nw, sw = (uint64_t)g->sw;
    if (Q_GROUP_GEN >= g->nw || g->tw >= g->nw || (uint64_t)g->gw + G_WORDS * (sw - S_GROUPS) > nw
            || g->cap > nw / sw || (uint64_t)g->sl + g->cap * sw > nw
            || g->size > (uint64_t)g->view.len || (uint64_t)g->data > (uint64_t)g->view.len - g->size) {
        PyBuffer_Release(&g->view);
        PyErr_Format(PyExc_ValueError, "%s: geometry past the end of the mapping", fn);
        return -1;
    }
    return 0;
}

static void
geom_close(Geom *g)
{
    PyBuffer_Release(&g->view);
}

/* ------------------------------------------------------------------ one delivery
 * deliver_one(geom, gi, word, now, ref, group) -> Message | None | False
 * geom = (mm, gw, sl, cap, sw, tail_word, data_off, size, cls, q), bound once per handle.
 * The compiled twin of core.delivery.Delivery.deliver_one, for a queue without a queue TTL
 * (the caller checks): None where the twin
 * returns None (the general path is needed); False where the twin must decide (the
 * message has a TTL of its own: the twin reads the wall clock).  The caller holds the
 * consumer lock.  The same aligned 8-byte stores as the twin, in the same order (lease
 * word, its crash point, cursor, delivered count, next expiry), each made only once the
 * message object is built (no allocation
 * can fail after the first store). */


/* The body of deliver_one, ``G`` open: the message leased, None, False, or NULL with an
 * exception set (an allocation failed: nothing stored). */
static PyObject *
deliver_locked(Geom *G, PyObject *cls, PyObject *q, Py_ssize_t gi, uint64_t word, uint64_t now,
               PyObject *ref, PyObject *group)
{
    sp_calls[CALL_DELIVER_ONE]++;
    volatile uint64_t *w = G->w;
    Py_ssize_t sl = G->sl, sw = G->sw, tw = G->tw, data = G->data;
    unsigned long long cap = G->cap, size = G->size;
    Py_ssize_t g = G->gw + gi * G_WORDS;
    uint64_t ne = w[g + G_NEXT_EXPIRY], cur = w[g + G_CURSOR];
    if ((ne && now >= ne) || w[g + G_REDELIVER] || cur >= w[tw])
        return Py_NewRef(Py_None);
    Py_ssize_t base = sl + (Py_ssize_t)(cur % cap) * sw;
    if (w[base + S_GROUPS + gi])  /* DONE: settled without a delivery */
        return Py_NewRef(Py_None);
    if (w[base + S_EXPIRES])  /* a TTL of its own: the twin reads the wall clock */
        return Py_NewRef(Py_False);
    uint64_t pos = w[base + S_BYTEPOS], lens = w[base + S_LENS], ts = w[base + S_TIMESTAMP];
    uint64_t start = (uint64_t)data + pos % size, mlen = lens >> 32, plen = lens & 0xFFFFFFFFull;
    const char *buf = (const char *)G->view.buf;
    Py_ssize_t len = G->view.len;
    if ((uint64_t)len < start || start + mlen + plen > (uint64_t)PY_SSIZE_T_MAX)
        start = (uint64_t)len, mlen = plen = 0;  /* out of the mapping: clamped to nothing */
    PyObject *payload = sp_slice_bytes(buf, len, (Py_ssize_t)(start + mlen), (Py_ssize_t)(start + mlen + plen));
    PyObject *meta = mlen ? sp_slice_bytes(buf, len, (Py_ssize_t)start, (Py_ssize_t)(start + mlen))
                          : PyBytes_FromStringAndSize(NULL, 0);
    PyObject *off = PyLong_FromUnsignedLongLong(cur), *stamp = PyLong_FromUnsignedLongLong(ts);
    PyObject *one = PyLong_FromLong(1);
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *t = type->tp_alloc(type, 8);
    if (payload == NULL || meta == NULL || off == NULL || stamp == NULL || one == NULL || t == NULL) {
        Py_XDECREF(payload);
        Py_XDECREF(meta);
        Py_XDECREF(off);
        Py_XDECREF(stamp);
        Py_XDECREF(one);
        Py_XDECREF(t);
        return NULL;
    }
    PyTuple_SET_ITEM(t, 0, Py_NewRef(q));
    PyTuple_SET_ITEM(t, 1, Py_NewRef(ref));
    PyTuple_SET_ITEM(t, 2, Py_NewRef(group));
    PyTuple_SET_ITEM(t, 3, off);
    PyTuple_SET_ITEM(t, 4, one);
    PyTuple_SET_ITEM(t, 5, payload);
    PyTuple_SET_ITEM(t, 6, meta);
    PyTuple_SET_ITEM(t, 7, stamp);
    /* the twin's stores, in its order, and its crash point */
    w[base + S_GROUPS + gi] = word;
    crash_point("deliver.one.leased");
    w[g + G_CURSOR] = cur + 1;
    w[g + G_DELIVERED] = w[g + G_DELIVERED] + 1;
    uint64_t deadline = word >> TIME_SHIFT;
    if (!ne || deadline < ne)
        w[g + G_NEXT_EXPIRY] = deadline;
    return t;
}

/* geom's message class and queue handle (a 10-tuple's last two), or -1 with TypeError */
static int
geom_cls(PyObject *geom, const char *fn, PyObject **cls, PyObject **q)
{
    if (PyTuple_CheckExact(geom) && PyTuple_GET_SIZE(geom) == 10) {
        *cls = PyTuple_GET_ITEM(geom, 8), *q = PyTuple_GET_ITEM(geom, 9);
        if (PyType_Check(*cls) && PyType_IsSubtype((PyTypeObject *)*cls, &PyTuple_Type))
            return 0;
    }
    PyErr_Format(PyExc_TypeError, "%s: geom must be a 10-tuple ending with a tuple type and a queue", fn);
    return -1;
}

PyObject *
sp_deliver_one(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "deliver_one(geom, gi, word, now, ref, group)");
        return NULL;
    }
    PyObject *cls, *q;
    if (geom_cls(args[0], "deliver_one", &cls, &q) < 0)
        return NULL;
    Py_ssize_t gi = PyLong_AsSsize_t(args[1]);
    unsigned long long word = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long now = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Geom G;
    if (geom_open(args[0], 10, "deliver_one", &G) < 0)
        return NULL;
    PyObject *res;
    if (gi < 0 || gi >= G.sw - S_GROUPS) {
        PyErr_SetString(PyExc_ValueError, "deliver_one: bad geometry (no such group)");
        res = NULL;
    } else {
        res = deliver_locked(&G, cls, q, gi, word, now, args[4], args[5]);
    }
    geom_close(&G);
    return res;
}

/* take_one(geom, ref, owner, vis_ms, group, lock, ggen, now) -> Message | None | False | int
 * The hot path of Consuming._take_one whole, in one call: the consumer lock at address
 * ``lock`` taken with pthread_mutex_trylock, the group table's generation checked against
 * ``ggen`` (the handle's), the lease word made (one delivery, ``owner``, a deadline
 * ``vis_ms`` after ``now``: ms of CLOCK_MONOTONIC, read here when ``now`` is -1, as
 * handle.monotonic_ms reads it), deliver_one's body, the lock let go of.  The lock not
 * taken at once (busy, or its holder died): trylock's error number, an int, and nothing
 * done (the caller takes the twin's path, which waits or recovers it).  None: the queue
 * is not active, the groups changed, or nothing new to deliver (deliver_one's None);
 * False: deliver_one's False. */
PyObject *
sp_take_one(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "take_one(geom, ref, owner, vis_ms, group, lock, ggen, now)");
        return NULL;
    }
    PyObject *cls, *q;
    if (geom_cls(args[0], "take_one", &cls, &q) < 0)
        return NULL;
    unsigned long long ref = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long owner = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long vis = PyLong_AsUnsignedLongLong(args[3]);
    pthread_mutex_t *lock = (pthread_mutex_t *)PyLong_AsVoidPtr(args[5]);
    uint64_t ggen = (uint64_t)PyLong_AsUnsignedLongLongMask(args[6]);  /* (-1 or any word: compared) */
    long long now = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (lock == NULL || owner >= (1ull << (TIME_SHIFT - OWNER_SHIFT))) {
        PyErr_SetString(PyExc_ValueError, "take_one: null lock or owner out of range");
        return NULL;
    }
    Geom G;
    if (geom_open(args[0], 10, "take_one", &G) < 0)
        return NULL;
    Py_ssize_t gi = (Py_ssize_t)(ref & GI_MASK);
    PyObject *res;
    if (gi >= G.sw - S_GROUPS) {
        PyErr_SetString(PyExc_ValueError, "take_one: bad geometry (no such group)");
        res = NULL;
    } else if (G.w[Q_STATE] != QS_ACTIVE) {
        res = Py_NewRef(Py_None);
    } else {
        if (now < 0)
            now = (long long)(mono_ns() / 1000000u);
        int rc = pthread_mutex_trylock(lock);
        if (rc) {
            res = PyLong_FromLong(rc);
        } else {
            if (G.w[Q_GROUP_GEN] != ggen) {  /* a group was created or deleted */
                res = Py_NewRef(Py_None);
            } else {
                uint64_t word = LEASED | (1ull << DC_SHIFT) | (owner << OWNER_SHIFT)
                                | (((uint64_t)now + vis) << TIME_SHIFT);
                res = deliver_locked(&G, cls, q, gi, word, (uint64_t)now, args[1], args[4]);
            }
            pthread_mutex_unlock(lock);
        }
    }
    geom_close(&G);
    return res;
}

/* What Settlement.advance_floor does after an ack, for a memory-only queue: the floor of
 * group entry ``g`` (lease word ``lw``) moved past DONE words, straight to ``done_to`` when
 * the caller knows every word below it is DONE (0: it knows nothing).  0 (OK) when no
 * storage was freed, 3 (FREED), or 4 where the twin would recompute the free offset.
 * Stores: the floor, then the free offset. */
static long
floor_after_ack(const Geom *G, Py_ssize_t g, Py_ssize_t lw, uint64_t done_to, long long lone_gen)
{
    volatile uint64_t *w = G->w;
    uint64_t f = w[g + G_FLOOR], old = f, cur = w[g + G_CURSOR];
    if (done_to > f)
        f = done_to < cur ? done_to : cur;
    while (f < cur && (w[G->sl + (Py_ssize_t)(f % G->cap) * G->sw + lw] & STATE_MASK) == DONE)
        f++;
    if (f == old)
        return 0;
    w[g + G_FLOOR] = f;
    crash_point("floor.moved");
    if (old != w[Q_FREE_OFFSET])  /* another group holds the free offset back */
        return 0;
    if (lone_gen >= 0 && w[Q_GROUP_GEN] == (uint64_t)lone_gen) {  /* its floor is the free offset */
        w[Q_FREE_OFFSET] = f;
        return 3;
    }
    return 4;
}

/* ack_one(geom, ref, offset, dc, lone_gen) -> int
 * The compiled twin of core.settlement.Settlement.ack followed by its advance_floor, for
 * a memory-only queue (no settle sequence to bump; the caller checks), under the consumer
 * lock the caller holds.  ``lone_gen``: the
 * Q_GROUP_GEN for which the caller's group table knows this is the queue's only group, or
 * -1.  Returns the twin's OK (0), STALE (1) or FREED (3); or 4 where the floor moved and
 * the twin would recompute the free offset (the caller then calls _recompute_free).  The
 * same stores as the twin in the same order: the lease word (DONE), the acked count, the
 * floor, the free offset. */


/* The body of ack_one, ``G`` open: its result, or -1 with ValueError set. */
static long
ack_locked(Geom *G, unsigned long long ref, unsigned long long offset, unsigned long long dc,
           long long lone_gen)
{
    sp_calls[CALL_ACK_ONE]++;
    Py_ssize_t gi = (Py_ssize_t)(ref & GI_MASK);
    if (gi >= G->sw - S_GROUPS || dc >= (1ull << (OWNER_SHIFT - DC_SHIFT))) {
        PyErr_SetString(PyExc_ValueError, "ack_one: bad geometry or delivery count");
        return -1;
    }
    volatile uint64_t *w = G->w;
    Py_ssize_t g = G->gw + gi * G_WORDS, lw = S_GROUPS + gi;
    if (w[g + G_SERIAL] != ref >> GI_BITS)  /* the group is gone */
        return 1;
    Py_ssize_t base = G->sl + (Py_ssize_t)(offset % G->cap) * G->sw;
    uint64_t word = w[base + lw];
    if ((word & ((1ull << OWNER_SHIFT) - 1)) != (LEASED | (dc << DC_SHIFT)) || w[base] != offset
            || offset >= w[Q_NEXT_OFFSET] || offset < w[g + G_FLOOR])
        return 1;
    w[base + lw] = DONE | (dc << DC_SHIFT);
    crash_point("ack.done");
    w[g + G_ACKED] = w[g + G_ACKED] + 1;
    return floor_after_ack(G, g, lw, 0, lone_gen);
}

PyObject *
sp_ack_one(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "ack_one(geom, ref, offset, dc, lone_gen)");
        return NULL;
    }
    unsigned long long ref = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long offset = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long dc = PyLong_AsUnsignedLongLong(args[3]);
    long long lone_gen = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Geom G;
    if (geom_open(args[0], 10, "ack_one", &G) < 0)
        return NULL;
    long rc = ack_locked(&G, ref, offset, dc, lone_gen);
    geom_close(&G);
    return rc < 0 ? NULL : PyLong_FromLong(rc);
}

/* ack_lock(geom, ref, offset, dc, lone_gen, lock) -> int
 * ack_one in one call with its lock: the consumer lock at address ``lock`` taken with
 * pthread_mutex_trylock, ack_one's body, the lock let go of; ack_one's result.  The lock
 * not taken at once (busy, or its holder died): minus trylock's error number, and nothing
 * done (the caller takes the path that waits or recovers it). */
PyObject *
sp_ack_lock(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "ack_lock(geom, ref, offset, dc, lone_gen, lock)");
        return NULL;
    }
    unsigned long long ref = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long offset = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long dc = PyLong_AsUnsignedLongLong(args[3]);
    long long lone_gen = PyLong_AsLongLong(args[4]);
    pthread_mutex_t *lock = (pthread_mutex_t *)PyLong_AsVoidPtr(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (lock == NULL) {
        PyErr_SetString(PyExc_ValueError, "ack_lock: null lock");
        return NULL;
    }
    Geom G;
    if (geom_open(args[0], 10, "ack_lock", &G) < 0)
        return NULL;
    long rc = pthread_mutex_trylock(lock);
    if (rc) {
        rc = -rc;
    } else {
        rc = ack_locked(&G, ref, offset, dc, lone_gen);
        pthread_mutex_unlock(lock);
    }
    geom_close(&G);
    return rc == -1 && PyErr_Occurred() ? NULL : PyLong_FromLong(rc);
}

/* put_one(geom, payload, meta, ts) -> int
 * geom = (mm, groups_w, slots_w, cap, sw, tail_word, data_off, size): Geom's, bound once per ring.
 * The compiled twin of the body of ring.Ring.try_put, under the producer lock the caller
 * holds, once the caller has settled a pending idempotent put: the new record's offset,
 * or -1 when there is no room
 * now.  The same stores as the twin in the same order: the record bytes (metadata, then
 * payload), the slot (head, then S_EXPIRES and the lease words zeroed), Q_TAIL_BYTES, and
 * last the commit, Q_NEXT_OFFSET, one aligned 8-byte store with release ordering (nothing
 * written before it can be seen after it). */

PyObject *
sp_put_one(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "put_one(geom, payload, meta, ts)");
        return NULL;
    }
    unsigned long long ts = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Geom G;
    Py_buffer pv, mv;
    if (geom_open(args[0], 8, "put_one", &G) < 0)
        return NULL;
    sp_calls[CALL_PUT_ONE]++;
    if (PyObject_GetBuffer(args[1], &pv, PyBUF_SIMPLE) < 0) {
        geom_close(&G);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &mv, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&pv);
        geom_close(&G);
        return NULL;
    }
    long long rc = -1;
    PyObject *res = NULL;
    volatile uint64_t *w = G.w;
    Py_ssize_t sl = G.sl, sw = G.sw, data = G.data;
    unsigned long long cap = G.cap, size = G.size;
    uint64_t plen = (uint64_t)pv.len, mlen = (uint64_t)mv.len, n = plen + mlen;
    uint64_t lens = plen | (mlen << 32);
    if (plen > 0xFFFFFFFFull || mlen > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_ValueError, "put_one: a payload or metadata of 4 GiB or more");
        goto done;
    }
    uint64_t off = w[Q_NEXT_OFFSET], free_ = w[Q_FREE_OFFSET];
    if (off - free_ >= cap)
        goto answer;
    uint64_t tb = w[Q_TAIL_BYTES], p, floor;
    if (free_ == off) {  /* empty: start the next lap at physical 0 */
        p = (tb + size - 1) / size * size;
        floor = p;
    }
    else {
        floor = w[sl + (Py_ssize_t)(free_ % cap) * sw + S_BYTEPOS];
        uint64_t phys = tb % size;
        p = phys + n <= size ? tb : tb + size - phys;
    }
    if (n > size || p + n - floor > size)
        goto answer;
    if ((uint64_t)data + p % size + n > (uint64_t)G.view.len) {  /* only a corrupt header gets here */
        PyErr_SetString(PyExc_ValueError, "put_one: a record past the end of the mapping");
        goto done;
    }
    char *start = (char *)G.view.buf + data + p % size;
    if (mlen)  /* metadata || payload, each copied once into place */
        memcpy(start, mv.buf, mlen);
    memcpy(start + mlen, pv.buf, plen);
    Py_ssize_t base = sl + (Py_ssize_t)(off % cap) * sw;
    w[base + S_OFFSET] = off;
    w[base + S_BYTEPOS] = p;
    w[base + S_LENS] = lens;
    w[base + S_TIMESTAMP] = ts;
    for (Py_ssize_t k = S_EXPIRES; k < sw; k++)
        w[base + k] = 0;
    w[Q_TAIL_BYTES] = p + n;
    crash_point("put.written");
    __atomic_store_n((uint64_t *)&w[Q_NEXT_OFFSET], off + 1, __ATOMIC_RELEASE);  /* commit */
    crash_point("put.committed");
    rc = (long long)off;
answer:
    res = PyLong_FromLongLong(rc);
done:
    PyBuffer_Release(&mv);
    PyBuffer_Release(&pv);
    geom_close(&G);
    return res;
}

/* settle_range(mm, sl, cap, sw, lw, start, end) -> int
 * The compiled twin of the loop of core.settlement.Settlement.commit (settle_range), under
 * the consumer lock the caller holds:
 * every lease word ``lw`` of the slots of offsets start .. end - 1 becomes DONE (a NEW
 * one plain DONE; a delayed one never delivered keeps its due time; any other keeps its
 * delivery count), except a DEADING one, left to finish its dead-letter copy.  The same
 * stores as the twin in the same order, one aligned 8-byte store per word, in offset
 * order.  Returns how many DEADING words it left. */
PyObject *
sp_settle_range(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "settle_range(mm, sl, cap, sw, lw, start, end)");
        return NULL;
    }
    Py_ssize_t sl = PyLong_AsSsize_t(args[1]);
    unsigned long long cap = PyLong_AsUnsignedLongLong(args[2]);
    Py_ssize_t sw = PyLong_AsSsize_t(args[3]);
    Py_ssize_t lw = PyLong_AsSsize_t(args[4]);
    unsigned long long start = PyLong_AsUnsignedLongLong(args[5]);
    unsigned long long end = PyLong_AsUnsignedLongLong(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (sl < 0 || cap == 0 || sw <= S_GROUPS || lw < S_GROUPS || lw >= sw) {
        PyErr_SetString(PyExc_ValueError, "settle_range: bad geometry");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (cap > (unsigned long long)(view.len / 8) / (unsigned long long)sw
            || (unsigned long long)sl + cap * (unsigned long long)sw > (unsigned long long)(view.len / 8)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "settle_range: geometry past the end of the mapping");
        return NULL;
    }
    sp_calls[CALL_SETTLE_RANGE]++;
    volatile uint64_t *w = (volatile uint64_t *)view.buf;
    const uint64_t state_dc = (1ull << OWNER_SHIFT) - 1;
    const uint64_t time_bits = ~((1ull << TIME_SHIFT) - 1);
    const uint64_t dc_bits = 0xFFull << DC_SHIFT;
    long left = 0;
    for (unsigned long long o = start; o < end; o++) {
        volatile uint64_t *p = w + sl + (Py_ssize_t)(o % cap) * sw + lw;
        uint64_t x = *p;
        if (!x)
            *p = DONE;
        else if ((x & STATE_MASK) == DEADING) {
            left++;
            continue;
        }
        else if ((x & state_dc) == READY || (x & state_dc) == DONE)
            *p = DONE | (x & time_bits);
        else
            *p = DONE | (x & dc_bits);
        crash_point("commit.word");
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(left);
}

/* ack_run(geom, msgs, q, lone_gen) -> int
 * The compiled twin of consume.ack_many's usual batch (Settlement.ack_offsets' strided
 * path and its advance_floor) on a memory-only queue (the caller checks), under the
 * consumer lock the caller holds: ``msgs``, a list of
 * at least two Messages delivered through ``q`` to one group, consecutive offsets with
 * one delivery count, none lapping the slot table, each one's lease word LEASED with that
 * count.  Returns -1, having written nothing, for any other batch (the twin decides: a
 * stale one, another group, a gap); else the twin's OK (0), FREED (3), or 4 where the
 * floor moved and the twin would recompute the free offset.  The same stores as the twin
 * in the same order: the lease words (DONE, in offset order), the acked count, the floor,
 * the free offset. */
PyObject *
sp_ack_run(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "ack_run(geom, msgs, q, lone_gen)");
        return NULL;
    }
    PyObject *msgs = args[1], *q = args[2];
    long long lone_gen = PyLong_AsLongLong(args[3]);
    if (lone_gen == -1 && PyErr_Occurred())
        return NULL;
    if (!PyList_Check(msgs)) {
        PyErr_SetString(PyExc_TypeError, "ack_run: msgs must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(msgs);
    if (n < 2)
        return PyLong_FromLong(-1);
    /* the batch's shape, from the messages alone */
    unsigned long long ref = 0, o0 = 0, dc = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(msgs, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) < 5 || PyTuple_GET_ITEM(m, 0) != q)
            return PyLong_FromLong(-1);
        PyObject *r = PyTuple_GET_ITEM(m, 1), *o = PyTuple_GET_ITEM(m, 3), *d = PyTuple_GET_ITEM(m, 4);
        if (!PyLong_CheckExact(r) || !PyLong_CheckExact(o) || !PyLong_CheckExact(d))
            return PyLong_FromLong(-1);
        unsigned long long rv = PyLong_AsUnsignedLongLong(r), ov = PyLong_AsUnsignedLongLong(o);
        unsigned long long dv = PyLong_AsUnsignedLongLong(d);
        if (PyErr_Occurred()) {  /* a negative reference (a read's message): the twin's */
            PyErr_Clear();
            return PyLong_FromLong(-1);
        }
        if (i == 0)
            ref = rv, o0 = ov, dc = dv;
        else if (rv != ref || dv != dc || ov != o0 + (unsigned long long)i)
            return PyLong_FromLong(-1);
    }
    Geom G;
    if (geom_open(args[0], 10, "ack_run", &G) < 0)
        return NULL;
    sp_calls[CALL_ACK_RUN]++;
    Py_ssize_t gi = (Py_ssize_t)(ref & GI_MASK);
    if (gi >= G.sw - S_GROUPS || dc >= (1ull << (OWNER_SHIFT - DC_SHIFT))) {
        geom_close(&G);
        return PyLong_FromLong(-1);
    }
    volatile uint64_t *w = G.w;
    Py_ssize_t sl = G.sl, sw = G.sw, g = G.gw + gi * G_WORDS, lw = S_GROUPS + gi;
    unsigned long long cap = G.cap;
    long rc = -1;
    uint64_t leased = LEASED | (dc << DC_SHIFT), state_dc = (1ull << OWNER_SHIFT) - 1;
    if (w[g + G_SERIAL] != ref >> GI_BITS || (o0 % cap) + (unsigned long long)n > cap
            || o0 + (unsigned long long)n > w[Q_NEXT_OFFSET] || o0 < w[g + G_FLOOR])
        goto done;
    Py_ssize_t b0 = sl + (Py_ssize_t)(o0 % cap) * sw;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t b = b0 + i * sw;
        if (w[b + S_OFFSET] != o0 + (unsigned long long)i || (w[b + lw] & state_dc) != leased)
            goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        w[b0 + i * sw + lw] = leased | DONE;
    crash_point("ack_range.done");
    w[g + G_ACKED] = w[g + G_ACKED] + (uint64_t)n;
    rc = floor_after_ack(&G, g, lw, o0 <= w[g + G_FLOOR] ? o0 + (uint64_t)n : 0, lone_gen);
done:
    geom_close(&G);
    return PyLong_FromLong(rc);
}

/* ------------------------------------------------------------------ a consumer's spin
 * spin_wait(geom, gi, window_ns, now) -> bool
 * The compiled twin of core.consumer.Consuming._spin_wait: True at once when group ``gi``
 * has a lease expiry due at ``now`` (ms); else re-read the queue's tail word and the
 * group's cursor and redelivery count until a message is published past the cursor or
 * one is given back (True), or ``window_ns`` of CLOCK_MONOTONIC have passed (False).  It
 * only reads; the GIL is let go of meanwhile (another thread of this process may be the
 * producer).  The mapping's buffer is held for the spin, and a handle's mapping is vacated,
 * never unmapped, while the handle lives (core.segment.Mapping.vacate): a queue deleted
 * meanwhile reads zeros, and the spin ends with its window. */

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int
spin_until(volatile uint64_t *tail, volatile uint64_t *g, uint64_t window)
{
    uint64_t end = mono_ns() + window;
    for (;;) {
        for (int i = 0; i < 8; i++) {
            if (*tail > g[G_CURSOR] || g[G_REDELIVER])
                return 1;
            cpu_relax();
        }
        if (mono_ns() >= end)
            return *tail > g[G_CURSOR] || g[G_REDELIVER];
    }
}

PyObject *
sp_spin_wait(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "spin_wait(geom, gi, window_ns, now)");
        return NULL;
    }
    Py_ssize_t gi = PyLong_AsSsize_t(args[1]);
    long long window = PyLong_AsLongLong(args[2]);
    unsigned long long now = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Geom g;
    if (geom_open(args[0], 10, "spin_wait", &g) < 0)
        return NULL;
    if (gi < 0 || gi >= g.sw - S_GROUPS || window < 0) {
        geom_close(&g);
        PyErr_SetString(PyExc_ValueError, "spin_wait: group index or window out of range");
        return NULL;
    }
    volatile uint64_t *grp = g.w + g.gw + gi * G_WORDS;
    uint64_t ne = grp[G_NEXT_EXPIRY];
    int found = 1;
    if (!(ne && now >= ne)) {
        Py_BEGIN_ALLOW_THREADS
        found = spin_until(g.w + g.tw, grp, (uint64_t)window);
        Py_END_ALLOW_THREADS
    }
    geom_close(&g);
    return PyBool_FromLong(found);
}
