/* shmq/_speedups.h: what the sources of shmq._speedups share (shmq/_speedups.c, the module;
 * shmq/_speedups_one.c, the one-message put, get and ack; shmq/_speedups_wire.c, a
 * consumer's messages from an answer's bytes).  The slot words are those of
 * shmq/core/layout.py. */
#ifndef SHMQ_SPEEDUPS_H
#define SHMQ_SPEEDUPS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define S_OFFSET 0
#define S_BYTEPOS 1
#define S_LENS 2
#define S_TIMESTAMP 3

/* big-endian (the wire's order) from and to this machine's */
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define BE64(x) (x)
#define BE32(x) (x)
#else
#define BE64(x) __builtin_bswap64(x)
#define BE32(x) __builtin_bswap32(x)
#endif

/* b[a:b] of buf[0:len] as bytes, clamped as Python's slicing clamps */
PyObject *sp_slice_bytes(const char *buf, Py_ssize_t len, Py_ssize_t a, Py_ssize_t b);

/* cls((*prefix, off, dc, payload, meta, stamp)) appended to the list out (cls a tuple
 * subclass: api.Message); takes the five references, also when one is NULL or on failure
 * (then -1, with a Python error set) */
int sp_append_message(PyObject *out, PyTypeObject *type, PyObject *prefix, PyObject *off, PyObject *dc,
                      PyObject *payload, PyObject *meta, PyObject *stamp);

/* Crash points inside the stores (shmq.crashpoints, which arms them through crash_arm):
 * the armed point's name ("" when none) and the passes left before the kill.  Unarmed, a
 * point costs the test of one byte. */
extern char sp_crash_name[64];
extern long sp_crash_left;

static inline void
crash_point(const char *name)
{
    if (sp_crash_name[0] && strcmp(name, sp_crash_name) == 0 && --sp_crash_left <= 0)
        kill(getpid(), SIGKILL);
}

/* Calls of each function that writes shared memory, in this process (``calls()``): how a
 * test proves which implementation ran. */
enum { CALL_PUT_ONE, CALL_DELIVER_ONE, CALL_ACK_ONE, CALL_ACK_RUN, CALL_SETTLE_RANGE, N_CALLS };
extern unsigned long long sp_calls[N_CALLS];

PyObject *sp_deliver_one(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *sp_ack_one(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *sp_put_one(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *sp_settle_range(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *sp_ack_run(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *sp_wire_records(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *sp_take_one(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *sp_ack_lock(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *sp_spin_wait(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
#endif
