/* A sharded Pub/Sub connection's reader in C: RESP2 bytes in, sequenced text messages out to
 * their channels' sinks (fairway/redis_client/dispatch.py says what they are).
 *
 * A busy gateway relays tens of thousands of token events a second, each one such a message. In
 * Python each cost a parsed message (a list and three strings) and a few function calls: more
 * CPU than what the stream then does with it. Here one call takes a whole socket read:
 *
 *   Dispatcher.feed(data, now) parses the RESP2 messages in data (keeping a partial one for the
 *   next call). A sequenced text message ("smessage", channel, "<n> t<head>\x1f<text>") whose
 *   channel has a Tap in the dispatcher's TapTable, and whose n is the tap's cursor + 1, goes to
 *   the tap's sink right here. Every other message comes back, parsed as hiredis would (a list
 *   of str / int / None; error replies as instances of the error class given), for the Python
 *   side to handle.
 *
 *   Tap(sink) is one channel tapped into its sink (sink(n, text) -> bool). A sink whose type
 *   carries the C-level protocol of fairway/csrc/token_sink.h is handed the text's UTF-8 bytes
 *   through a function pointer, with no Python object built; any other sink is called as
 *   sink(n, text). When the sink takes the message, the tap moves its cursor to n and notes `now`
 *   in last.
 *
 *   TapTable() maps channels (str) to Taps for Python as a dict would (t[channel] = tap, get, pop,
 *   del, clear), and for the dispatcher by the channel's bytes as they arrived: a slot of hash and
 *   tap, the channel's bytes kept in the tap itself. A dict lookup built a str a message and
 *   touched the dict's index, its entry and the key, each a cache miss once hundreds of streams
 *   took turns (bench/README.md, event_path.py); here a message touches its slot and its tap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "buf.h"
#include "token_sink.h"

/* -- Tap ----------------------------------------------------------------------------------- */

enum { TAP_INLINE_CHANNEL = 64 };

typedef struct {
    PyObject_HEAD
    PyObject *sink;
    const FairwayTokenSink *api;  /* the sink type's C-level protocol, or NULL: call it */
    long long cursor;
    double last;
    /* The channel's UTF-8 while the tap is in a TapTable (channel_len < 0: in none), inline up to
       TAP_INLINE_CHANNEL bytes, past the fields a message reads first. */
    Py_ssize_t channel_len;
    char *channel;
    char inline_channel[TAP_INLINE_CHANNEL];
} Tap;

static PyTypeObject TapType;

static int Tap_init(Tap *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"sink", NULL};
    PyObject *sink;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", names, &sink)) return -1;
    if (!PyCallable_Check(sink)) {
        PyErr_SetString(PyExc_TypeError, "a tap's sink must be callable");
        return -1;
    }
    self->api = NULL;
    PyObject *capsule = PyObject_GetAttrString((PyObject *)Py_TYPE(sink), FAIRWAY_TOKEN_SINK_ATTR);
    if (capsule && PyCapsule_IsValid(capsule, FAIRWAY_TOKEN_SINK))
        self->api = PyCapsule_GetPointer(capsule, FAIRWAY_TOKEN_SINK);
    Py_XDECREF(capsule);
    PyErr_Clear();  /* no protocol: the sink is called */
    Py_INCREF(sink);
    Py_XSETREF(self->sink, sink);
    return 0;
}

static int Tap_traverse(Tap *self, visitproc visit, void *arg) {
    Py_VISIT(self->sink);
    return 0;
}

static int Tap_clear(Tap *self) {
    Py_CLEAR(self->sink);
    return 0;
}

static void tap_forget_channel(Tap *self) {
    if (self->channel != self->inline_channel) PyMem_Free(self->channel);
    self->channel = NULL;
    self->channel_len = -1;
}

static int tap_set_channel(Tap *self, const char *s, Py_ssize_t n) {
    char *at = self->inline_channel;
    if (n > TAP_INLINE_CHANNEL && !(at = PyMem_Malloc(n))) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(at, s, n);
    self->channel = at;
    self->channel_len = n;
    return 0;
}

static void Tap_dealloc(Tap *self) {
    PyObject_GC_UnTrack(self);
    Tap_clear(self);
    tap_forget_channel(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Tap_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Tap *self = (Tap *)PyType_GenericNew(type, args, kwds);
    if (self) self->channel_len = -1;
    return (PyObject *)self;
}

/* Hand message n to the sink: 1 taken, 0 declined, -1 error. */
static int tap_take(Tap *self, long long n, const char *text, Py_ssize_t len) {
    if (self->api) return self->api->take(self->sink, n, text, len);
    PyObject *args[2] = {PyLong_FromLongLong(n), PyUnicode_DecodeUTF8(text, len, "replace")};
    PyObject *result = args[0] && args[1] ? PyObject_Vectorcall(self->sink, args, 2, NULL) : NULL;
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    if (!result) return -1;
    int took = PyObject_IsTrue(result);
    Py_DECREF(result);
    return took;
}

static PyMemberDef Tap_members[] = {
    {"sink", T_OBJECT, offsetof(Tap, sink), READONLY, "what takes the channel's messages"},
    {"cursor", T_LONGLONG, offsetof(Tap, cursor), 0, "n of the last message the sink took from a dispatcher"},
    {"last", T_DOUBLE, offsetof(Tap, last), 0, "the `now` of the feed() that handed it"},
    {NULL}
};

static PyObject *Tap_get_native(Tap *self, void *closure) {
    return PyBool_FromLong(self->api != NULL);
}

static PyGetSetDef Tap_getset[] = {
    {"native", (getter)Tap_get_native, NULL, "whether the sink is handed events through its C-level protocol", NULL},
    {NULL}
};

static PyTypeObject TapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fairway_redis_dispatch.Tap",
    .tp_basicsize = sizeof(Tap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Tap(sink): a channel tapped into its sink",
    .tp_new = Tap_new,
    .tp_init = (initproc)Tap_init,
    .tp_dealloc = (destructor)Tap_dealloc,
    .tp_traverse = (traverseproc)Tap_traverse,
    .tp_clear = (inquiry)Tap_clear,
    .tp_members = Tap_members,
    .tp_getset = Tap_getset,
};

/* -- TapTable ------------------------------------------------------------------------------ */

enum { SLOT_EMPTY = 0, SLOT_DELETED = 1, TABLE_MIN = 8 };

typedef struct {
    uint64_t hash;  /* SLOT_EMPTY, SLOT_DELETED, or its tap's channel's hash (never either) */
    Tap *tap;       /* owned; its channel is the key */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    Py_ssize_t mask;    /* slots - 1 (a power of two; no slots at all while empty) */
    Py_ssize_t used;    /* taps */
    Py_ssize_t filled;  /* taps and deleted slots: at most half the slots, so a probe ends */
} TapTable;

static PyTypeObject TapTableType;

/* The channel names are the relay's own (a reply id's), not chosen by a client: a fast multiply
   mix, 8 bytes a step, is enough; equal hashes are told apart by the bytes. */
static uint64_t channel_hash(const char *s, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n, w;
    for (; n >= 8; s += 8, n -= 8) {
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
    }
    w = 0;
    memcpy(&w, s, (size_t)n);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 29;
    return h > SLOT_DELETED ? h : h + 2;
}

/* The slot holding channel s (n bytes, hash h), or -1. */
static Py_ssize_t table_find(const TapTable *t, const char *s, Py_ssize_t n, uint64_t h) {
    if (!t->slots) return -1;
    for (Py_ssize_t i = (Py_ssize_t)(h & (uint64_t)t->mask);; i = (i + 1) & t->mask) {
        const Slot *slot = &t->slots[i];
        if (slot->hash == SLOT_EMPTY) return -1;
        if (slot->hash == h && slot->tap->channel_len == n && memcmp(slot->tap->channel, s, n) == 0) return i;
    }
}

static void table_place(Slot *slots, Py_ssize_t mask, uint64_t h, Tap *tap) {
    Py_ssize_t i = (Py_ssize_t)(h & (uint64_t)mask);
    while (slots[i].hash > SLOT_DELETED) i = (i + 1) & mask;
    slots[i].hash = h;
    slots[i].tap = tap;
}

/* Room for one more tap: the slots rebuilt (deleted ones dropped) once taps and deleted slots
   would pass half of them. */
static int table_reserve(TapTable *t) {
    Py_ssize_t size = t->slots ? t->mask + 1 : 0;
    if ((t->filled + 1) * 2 <= size) return 0;
    Py_ssize_t want = TABLE_MIN;
    while (want < (t->used + 1) * 4) want *= 2;
    Slot *slots = PyMem_Calloc((size_t)want, sizeof(Slot));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++)
        if (t->slots[i].hash > SLOT_DELETED) table_place(slots, want - 1, t->slots[i].hash, t->slots[i].tap);
    PyMem_Free(t->slots);
    t->slots = slots;
    t->mask = want - 1;
    t->filled = t->used;
    return 0;
}

/* The key's UTF-8 and hash; -1 with TypeError if it is not a str. */
static int table_key(PyObject *key, const char **s, Py_ssize_t *n, uint64_t *h) {
    if (!PyUnicode_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "a TapTable's keys are channels (str)");
        return -1;
    }
    if (!(*s = PyUnicode_AsUTF8AndSize(key, n))) return -1;
    *h = channel_hash(*s, *n);
    return 0;
}

/* Take slot i's tap out (a new reference for the caller). */
static Tap *table_take(TapTable *t, Py_ssize_t i) {
    Tap *tap = t->slots[i].tap;
    t->slots[i].hash = SLOT_DELETED;
    t->slots[i].tap = NULL;
    t->used--;
    tap_forget_channel(tap);
    return tap;
}

static int table_set(TapTable *t, PyObject *key, PyObject *value) {
    const char *s;
    Py_ssize_t n;
    uint64_t h;
    if (table_key(key, &s, &n, &h) < 0) return -1;
    Py_ssize_t i = table_find(t, s, n, h);
    if (!value) {  /* del t[key] */
        if (i < 0) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        Py_DECREF(table_take(t, i));
        return 0;
    }
    if (!PyObject_TypeCheck(value, &TapType)) {
        PyErr_SetString(PyExc_TypeError, "a TapTable holds Taps");
        return -1;
    }
    Tap *tap = (Tap *)value;
    if (i >= 0 && t->slots[i].tap == tap) return 0;
    if (tap->channel_len >= 0) {
        PyErr_SetString(PyExc_ValueError, "a tap is under one channel of one table at a time");
        return -1;
    }
    /* What can fail comes first, so a failed t[key] = tap leaves the key's tap in place, as a
       dict's does; the room made may move the slots, so the key's is found again after it. */
    if (table_reserve(t) < 0 || tap_set_channel(tap, s, n) < 0) return -1;
    i = table_find(t, s, n, h);
    Tap *old = i >= 0 ? table_take(t, i) : NULL;
    Py_INCREF(tap);
    table_place(t->slots, t->mask, h, tap);
    t->used++;
    t->filled++;
    Py_XDECREF(old);
    return 0;
}

static Py_ssize_t TapTable_length(TapTable *t) { return t->used; }

static Py_ssize_t table_lookup(TapTable *t, PyObject *key) {
    const char *s;
    Py_ssize_t n;
    uint64_t h;
    if (table_key(key, &s, &n, &h) < 0) return -2;
    return table_find(t, s, n, h);
}

static PyObject *TapTable_subscript(TapTable *t, PyObject *key) {
    Py_ssize_t i = table_lookup(t, key);
    if (i == -2) return NULL;
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return Py_NewRef((PyObject *)t->slots[i].tap);
}

static int TapTable_contains(TapTable *t, PyObject *key) {
    Py_ssize_t i = table_lookup(t, key);
    return i == -2 ? -1 : i >= 0;
}

static int one_or_two(const char *name, Py_ssize_t nargs) {
    if (nargs == 1 || nargs == 2) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes a channel and an optional default", name);
    return 0;
}

static PyObject *TapTable_get(TapTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (!one_or_two("get", nargs)) return NULL;
    Py_ssize_t i = table_lookup(t, args[0]);
    if (i == -2) return NULL;
    return Py_NewRef(i >= 0 ? (PyObject *)t->slots[i].tap : nargs > 1 ? args[1] : Py_None);
}

static PyObject *TapTable_pop(TapTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (!one_or_two("pop", nargs)) return NULL;
    Py_ssize_t i = table_lookup(t, args[0]);
    if (i == -2) return NULL;
    if (i >= 0) return (PyObject *)table_take(t, i);
    if (nargs > 1) return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static int TapTable_clear(TapTable *t) {
    Slot *slots = t->slots;
    Py_ssize_t size = slots ? t->mask + 1 : 0;
    t->slots = NULL;
    t->mask = t->used = t->filled = 0;
    for (Py_ssize_t i = 0; i < size; i++) {
        if (slots[i].hash > SLOT_DELETED) {
            tap_forget_channel(slots[i].tap);
            Py_DECREF(slots[i].tap);
        }
    }
    PyMem_Free(slots);
    return 0;
}

static PyObject *TapTable_clear_method(TapTable *t, PyObject *Py_UNUSED(ignored)) {
    TapTable_clear(t);
    Py_RETURN_NONE;
}

static int TapTable_traverse(TapTable *t, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; t->slots && i <= t->mask; i++)
        if (t->slots[i].hash > SLOT_DELETED) Py_VISIT(t->slots[i].tap);
    return 0;
}

static void TapTable_dealloc(TapTable *t) {
    PyObject_GC_UnTrack(t);
    TapTable_clear(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMappingMethods TapTable_mapping = {
    .mp_length = (lenfunc)TapTable_length,
    .mp_subscript = (binaryfunc)TapTable_subscript,
    .mp_ass_subscript = (objobjargproc)table_set,
};

static PySequenceMethods TapTable_sequence = {
    .sq_contains = (objobjproc)TapTable_contains,
};

static PyMethodDef TapTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))TapTable_get, METH_FASTCALL, "get(channel, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))TapTable_pop, METH_FASTCALL, "pop(channel[, default])"},
    {"clear", (PyCFunction)TapTable_clear_method, METH_NOARGS, "clear(): every tap out"},
    {NULL}
};

static PyTypeObject TapTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fairway_redis_dispatch.TapTable",
    .tp_basicsize = sizeof(TapTable),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "TapTable(): channel (str) -> Tap, for a Dispatcher",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)TapTable_dealloc,
    .tp_traverse = (traverseproc)TapTable_traverse,
    .tp_clear = (inquiry)TapTable_clear,
    .tp_as_mapping = &TapTable_mapping,
    .tp_as_sequence = &TapTable_sequence,
    .tp_methods = TapTable_methods,
};

/* -- RESP2 --------------------------------------------------------------------------------- */

/* The line starting at p ends before "\r\n": returns the end, or NULL if not all here. */
static const char *line_end(const char *p, const char *end) {
    const char *cr = memchr(p, '\r', end - p);
    while (cr && cr + 1 < end && cr[1] != '\n') cr = memchr(cr + 1, '\r', end - cr - 1);
    return (cr && cr + 1 < end) ? cr : NULL;
}

static int parse_len(const char *p, const char *e, long long *out) {
    int neg = 0;
    long long v = 0;
    if (p < e && *p == '-') { neg = 1; p++; }
    if (p == e) return -1;
    for (; p < e; p++) {
        if (*p < '0' || *p > '9' || v > (1LL << 50)) return -1;
        v = v * 10 + (*p - '0');
    }
    *out = neg ? -v : v;
    return 0;
}

#define INCOMPLETE ((const char *)1)

/* Skip one value: the byte after it, INCOMPLETE if not all here, NULL (error set) if malformed. */
static const char *skip(const char *p, const char *end, int depth) {
    if (p >= end) return INCOMPLETE;
    const char *e = line_end(p + 1, end);
    if (!e) return INCOMPLETE;
    long long n;
    switch (*p) {
        case '+': case '-': case ':':
            return e + 2;
        case '$':
            if (parse_len(p + 1, e, &n) < 0) break;
            if (n < 0) return e + 2;
            if (end - (e + 2) < n + 2) return INCOMPLETE;
            return e + 2 + n + 2;
        case '*':
            if (parse_len(p + 1, e, &n) < 0 || depth > 8) break;
            p = e + 2;
            for (long long i = 0; i < n; i++) {
                p = skip(p, end, depth + 1);
                if (p == NULL || p == INCOMPLETE) return p;
            }
            return p;
    }
    PyErr_SetString(PyExc_ValueError, "Redis sent something that is not RESP2");
    return NULL;
}

/* Build a complete value (skip() said it is all here). */
static PyObject *build(const char **pp, PyObject *error_class) {
    const char *p = *pp;
    const char *e = strstr(p, "\r\n");  /* complete: the terminator is there */
    long long n;
    PyObject *value = NULL;
    switch (*p) {
        case '+':
            value = PyUnicode_DecodeUTF8(p + 1, e - p - 1, "replace");
            *pp = e + 2;
            return value;
        case '-':
            value = PyObject_CallFunction(error_class, "s#", p + 1, (Py_ssize_t)(e - p - 1));
            *pp = e + 2;
            return value;
        case ':':
            parse_len(p + 1, e, &n);
            *pp = e + 2;
            return PyLong_FromLongLong(n);
        case '$':
            parse_len(p + 1, e, &n);
            if (n < 0) {
                *pp = e + 2;
                Py_RETURN_NONE;
            }
            value = PyUnicode_DecodeUTF8(e + 2, n, "replace");
            *pp = e + 2 + n + 2;
            return value;
        case '*':
            parse_len(p + 1, e, &n);
            *pp = e + 2;
            if (n < 0) Py_RETURN_NONE;
            value = PyList_New(n);
            if (!value) return NULL;
            for (long long i = 0; i < n; i++) {
                PyObject *item = build(pp, error_class);
                if (!item) {
                    Py_DECREF(value);
                    return NULL;
                }
                PyList_SET_ITEM(value, i, item);
            }
            return value;
    }
    PyErr_SetString(PyExc_ValueError, "Redis sent something that is not RESP2");
    return NULL;
}

/* A bulk string at p: its bytes in (*s, *n) and the byte after it; NULL if p is not one. */
static const char *bulk(const char *p, const char *end, const char **s, Py_ssize_t *n) {
    if (p >= end || *p != '$') return NULL;
    const char *e = line_end(p + 1, end);
    long long len;
    if (!e || parse_len(p + 1, e, &len) < 0 || len < 0) return NULL;
    *s = e + 2;
    *n = (Py_ssize_t)len;
    return e + 2 + len + 2;
}

/* -- Dispatcher ---------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *taps;         /* TapTable: channel -> Tap */
    PyObject *error_class;  /* what an error reply becomes */
    Buf pending;            /* bytes of a message not complete yet */
} Dispatcher;

static int Dispatcher_init(Dispatcher *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"taps", "error_class", NULL};
    PyObject *taps, *error_class;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O", names, &TapTableType, &taps, &error_class)) return -1;
    Py_INCREF(taps); Py_XSETREF(self->taps, taps);
    Py_INCREF(error_class); Py_XSETREF(self->error_class, error_class);
    self->pending.len = 0;
    return 0;
}

static int Dispatcher_traverse(Dispatcher *self, visitproc visit, void *arg) {
    Py_VISIT(self->taps);
    Py_VISIT(self->error_class);
    return 0;
}

static int Dispatcher_clear(Dispatcher *self) {
    Py_CLEAR(self->taps);
    Py_CLEAR(self->error_class);
    return 0;
}

static void Dispatcher_dealloc(Dispatcher *self) {
    PyObject_GC_UnTrack(self);
    Dispatcher_clear(self);
    PyMem_Free(self->pending.data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The fast path for one complete message at p..next: 1 taken, 0 not for it, -1 error. */
static int try_tap(Dispatcher *self, const char *p, const char *next, double now) {
    static const char HEAD[] = "*3\r\n$8\r\nsmessage\r\n";
    if (next - p < (Py_ssize_t)sizeof HEAD - 1 || memcmp(p, HEAD, sizeof HEAD - 1) != 0) return 0;
    const char *channel, *payload;
    Py_ssize_t channel_len, payload_len;
    const char *q = bulk(p + sizeof HEAD - 1, next, &channel, &channel_len);
    if (!q || !bulk(q, next, &payload, &payload_len)) return 0;
    /* "<n> t<head>\x1f<text>" */
    const char *end = payload + payload_len, *s = payload;
    long long n = 0;
    while (s < end && *s >= '0' && *s <= '9' && n < (1LL << 50)) n = n * 10 + (*s++ - '0');
    if (s == payload || end - s < 2 || s[0] != ' ' || s[1] != 't') return 0;
    const char *sep = memchr(s + 2, '\x1f', end - s - 2);
    if (!sep) return 0;
    const TapTable *table = (const TapTable *)self->taps;
    Py_ssize_t slot = table_find(table, channel, channel_len, channel_hash(channel, channel_len));
    if (slot < 0) return 0;
    Tap *t = table->slots[slot].tap;
    if (n != t->cursor + 1) return 0;
    Py_INCREF(t);  /* the sink may drop it from the table */
    int took = tap_take(t, n, sep + 1, end - sep - 1);
    if (took == 1) {
        t->cursor = n;
        t->last = now;
    } else if (took < 0) {
        /* A sink that raised: the Python path takes this message, and the error surfaces in the
           subscriber's own task, not in every subscriber of this connection. */
        PyErr_Clear();
        took = 0;
    }
    Py_DECREF(t);
    return took;
}

static PyObject *Dispatcher_feed(Dispatcher *self, PyObject *args) {
    Py_buffer data;
    double now;
    if (!PyArg_ParseTuple(args, "y*d", &data, &now)) return NULL;
    Buf *b = &self->pending;
    if (buf_put(b, data.buf, data.len) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    PyBuffer_Release(&data);
    if (buf_reserve(b, 1) < 0) return NULL;
    b->data[b->len] = '\0';  /* (build() finds line ends with strstr) */
    PyObject *rest = PyList_New(0);
    if (!rest) return NULL;
    const char *p = b->data, *end = b->data + b->len;
    while (p < end) {
        const char *next = skip(p, end, 0);
        if (next == INCOMPLETE) break;
        if (next == NULL) goto fail;
        int took = try_tap(self, p, next, now);
        if (took < 0) goto fail;
        if (!took) {
            const char *q = p;
            PyObject *message = build(&q, self->error_class);
            if (!message) goto fail;
            int failed = PyList_Append(rest, message);
            Py_DECREF(message);
            if (failed) goto fail;
        }
        p = next;
    }
    b->len = end - p;
    memmove(b->data, p, b->len);
    return rest;
fail:
    /* Everything before p was handled; drop the rest (the stream cannot be trusted). */
    b->len = 0;
    Py_DECREF(rest);
    return NULL;
}

static PyMethodDef Dispatcher_methods[] = {
    {"feed", (PyCFunction)Dispatcher_feed, METH_VARARGS,
     "feed(data, now) -> list: the messages no tap's sink took, parsed"},
    {NULL}
};

static PyMemberDef Dispatcher_members[] = {
    {"taps", T_OBJECT, offsetof(Dispatcher, taps), READONLY, "its TapTable: channel -> Tap"},
    {NULL}
};

static PyTypeObject DispatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fairway_redis_dispatch.Dispatcher",
    .tp_basicsize = sizeof(Dispatcher),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Dispatcher(taps, error_class): RESP2 Pub/Sub bytes to the taps of a TapTable, the rest parsed",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Dispatcher_init,
    .tp_dealloc = (destructor)Dispatcher_dealloc,
    .tp_traverse = (traverseproc)Dispatcher_traverse,
    .tp_clear = (inquiry)Dispatcher_clear,
    .tp_methods = Dispatcher_methods,
    .tp_members = Dispatcher_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fairway_redis_dispatch", "Sharded Pub/Sub bytes to the sinks of tapped channels.", -1, NULL,
};

PyMODINIT_FUNC PyInit_fairway_redis_dispatch(void) {
    if (PyType_Ready(&TapType) < 0 || PyType_Ready(&TapTableType) < 0 || PyType_Ready(&DispatcherType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&TapType);
    Py_INCREF(&TapTableType);
    Py_INCREF(&DispatcherType);
    if (PyModule_AddObject(m, "Tap", (PyObject *)&TapType) < 0
        || PyModule_AddObject(m, "TapTable", (PyObject *)&TapTableType) < 0
        || PyModule_AddObject(m, "Dispatcher", (PyObject *)&DispatcherType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
