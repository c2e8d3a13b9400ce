/* The relay's per-event path in C: Redis Pub/Sub bytes in, SSE token chunks out.
 *
 * A busy gateway relays tens of thousands of token events a second. In Python each one cost a
 * parsed message (a list and three strings), a few function calls and the chunk's formatting:
 * more CPU than the socket write that sends it. Here one call takes a whole socket read:
 *
 *   Dispatcher.feed(data, now) parses the RESP2 messages in data (keeping a partial one for the
 *   next call). A token message ("smessage", channel, "<n> t<ids>\x1f<text>") whose channel has a
 *   Tap in the dispatcher's taps dict, and whose n is the tap's cursor + 1, is formatted and
 *   handed to the tap's write callable right here, with no Python object but the chunk. Every
 *   other message comes back, parsed as hiredis would (a list of str / int / None; error replies
 *   as instances of the error class given), for the Python side to handle.
 *
 *   Tap(head, write, texts, open, transport) is one waiting stream's fast path. Its chunk is
 *   "id: <n>\ndata: " + head + <text as a JSON string> + the chunk's tail (the same bytes as the
 *   Python PyTap's, and as the gateway's JSON chunk). When write(chunk) says it wrote it, the tap
 *   appends the text to texts (the reply's text so far), moves its cursor to n and notes `now` in
 *   last. Called as tap(n, text) it is a relay.TokenSink (the Python path's direct sink).
 *   Given the response's transport (an HTTP/1.1 chunked response, started), the tap writes each
 *   chunk there itself, framed as an HTTP chunk, instead of calling write: only while the
 *   transport is open and has nothing buffered (so it never reorders bytes, nor writes past flow
 *   control: a transport with a backlog declines, and the stream's task sends through the server).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

static const char TAIL_A[] = "},\"finish_reason\":null,\"logprobs\":null,\"checkpoint_id\":\"tok_";
static const char TAIL_B[] = "\"}]}\n\n";

/* -- a growable byte buffer ---------------------------------------------------------------- */

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    char *data = PyMem_Realloc(b->data, cap);
    if (!data) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

static int buf_int(Buf *b, long long v) {
    char tmp[24], *p = tmp + sizeof tmp;  /* (snprintf: ~4% of a relayed event's CPU) */
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do { *--p = (char)('0' + u % 10); u /= 10; } while (u);
    if (v < 0) *--p = '-';
    return buf_put(b, p, tmp + sizeof tmp - p);
}

/* text (UTF-8) as a JSON string, escaped as Python's json.dumps(ensure_ascii=False) does */
static int buf_json_string(Buf *b, const char *s, Py_ssize_t n) {
    static const char hex[] = "0123456789abcdef";
    if (buf_reserve(b, n * 6 + 2) < 0) return -1;
    char *out = b->data + b->len;
    *out++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *out++ = (char)c;
            continue;
        }
        *out++ = '\\';
        switch (c) {
            case '"': *out++ = '"'; break;
            case '\\': *out++ = '\\'; break;
            case '\n': *out++ = 'n'; break;
            case '\r': *out++ = 'r'; break;
            case '\t': *out++ = 't'; break;
            case '\b': *out++ = 'b'; break;
            case '\f': *out++ = 'f'; break;
            default:
                *out++ = 'u'; *out++ = '0'; *out++ = '0';
                *out++ = hex[c >> 4]; *out++ = hex[c & 15];
        }
    }
    *out++ = '"';
    b->len = out - b->data;
    return 0;
}

/* -- Tap ----------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *head;   /* bytes */
    PyObject *write;  /* callable(bytes) -> bool */
    PyObject *texts;  /* list of str */
    PyObject *transport;  /* or NULL */
    PyObject *is_closing, *buffered, *write_transport;  /* its bound methods, looked up once */
    long long cursor;
    double last;
    int open;
    Buf scratch;
} Tap;

static PyTypeObject TapType;

static int Tap_init(Tap *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"head", "write", "texts", "open", "transport", NULL};
    PyObject *head, *write, *texts, *transport = Py_None;
    int open = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "SOO!|pO", names, &head, &write, &PyList_Type, &texts, &open,
                                     &transport))
        return -1;
    if (!PyCallable_Check(write)) {
        PyErr_SetString(PyExc_TypeError, "write must be callable");
        return -1;
    }
    Py_INCREF(head); Py_XSETREF(self->head, head);
    Py_INCREF(write); Py_XSETREF(self->write, write);
    Py_INCREF(texts); Py_XSETREF(self->texts, texts);
    Py_XSETREF(self->transport, transport == Py_None ? NULL : Py_NewRef(transport));
    Py_CLEAR(self->is_closing);
    Py_CLEAR(self->buffered);
    Py_CLEAR(self->write_transport);
    if (self->transport && (!(self->is_closing = PyObject_GetAttrString(transport, "is_closing"))
                            || !(self->buffered = PyObject_GetAttrString(transport, "get_write_buffer_size"))
                            || !(self->write_transport = PyObject_GetAttrString(transport, "write"))))
        return -1;
    self->open = open;
    return 0;
}

static int Tap_traverse(Tap *self, visitproc visit, void *arg) {
    Py_VISIT(self->head);
    Py_VISIT(self->write);
    Py_VISIT(self->texts);
    Py_VISIT(self->transport);
    Py_VISIT(self->is_closing);
    Py_VISIT(self->buffered);
    Py_VISIT(self->write_transport);
    return 0;
}

static int Tap_clear(Tap *self) {
    Py_CLEAR(self->head);
    Py_CLEAR(self->write);
    Py_CLEAR(self->texts);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->is_closing);
    Py_CLEAR(self->buffered);
    Py_CLEAR(self->write_transport);
    return 0;
}

static void Tap_dealloc(Tap *self) {
    PyObject_GC_UnTrack(self);
    Tap_clear(self);
    PyMem_Free(self->scratch.data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Token n's SSE event in self->scratch from offset `at`; -1 with an error set on failure. */
static int tap_format(Tap *self, Py_ssize_t at, long long n, const char *text, Py_ssize_t len) {
    Buf *b = &self->scratch;
    b->len = at;
    if (buf_put(b, "id: ", 4) < 0 || buf_int(b, n) < 0 || buf_put(b, "\ndata: ", 7) < 0
        || buf_put(b, PyBytes_AS_STRING(self->head), PyBytes_GET_SIZE(self->head)) < 0
        || buf_json_string(b, text, len) < 0 || buf_put(b, TAIL_A, sizeof TAIL_A - 1) < 0 || buf_int(b, n) < 0
        || buf_put(b, TAIL_B, sizeof TAIL_B - 1) < 0)
        return -1;
    return 0;
}

/* The chunk for token n with UTF-8 text, as bytes (new reference), or NULL with an error set. */
static PyObject *tap_chunk(Tap *self, long long n, const char *text, Py_ssize_t len) {
    if (tap_format(self, 0, n, text, len) < 0) return NULL;
    return PyBytes_FromStringAndSize(self->scratch.data, self->scratch.len);
}

/* Straight to the transport, as one HTTP/1.1 chunk: 1 written, 0 declined, -1 error. */
static int tap_write_transport(Tap *self, long long n, const char *text, Py_ssize_t len) {
    PyObject *r = PyObject_CallNoArgs(self->is_closing);
    if (!r) return -1;
    int closing = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (closing) return closing < 0 ? -1 : 0;
    if (!(r = PyObject_CallNoArgs(self->buffered))) return -1;
    Py_ssize_t buffered = PyLong_AsSsize_t(r);
    Py_DECREF(r);
    if (buffered != 0) return buffered < 0 && PyErr_Occurred() ? -1 : 0;
    /* "<hex size>\r\n" + event + "\r\n": the size line is written once the size is known */
    enum { SIZE_LINE = 18 };
    if (tap_format(self, SIZE_LINE, n, text, len) < 0 || buf_put(&self->scratch, "\r\n", 2) < 0) return -1;
    size_t size = (size_t)(self->scratch.len - SIZE_LINE - 2);
    char *start = self->scratch.data + SIZE_LINE;
    *--start = '\n';
    *--start = '\r';
    do { *--start = "0123456789abcdef"[size & 15]; size >>= 4; } while (size);
    PyObject *chunk = PyBytes_FromStringAndSize(start, self->scratch.data + self->scratch.len - start);
    if (!chunk) return -1;
    r = PyObject_CallOneArg(self->write_transport, chunk);
    Py_DECREF(chunk);
    if (!r) return -1;
    Py_DECREF(r);
    return 1;
}

/* Write token n: 1 written (text kept), 0 declined by write (or the tap is not open), -1 error. */
static int tap_take(Tap *self, long long n, const char *text, Py_ssize_t len, PyObject *text_obj) {
    if (!self->open) return 0;
    int wrote;
    if (self->transport) {
        wrote = tap_write_transport(self, n, text, len);
    } else {
        PyObject *chunk = tap_chunk(self, n, text, len);
        if (!chunk) return -1;
        PyObject *result = PyObject_CallOneArg(self->write, chunk);
        Py_DECREF(chunk);
        if (!result) return -1;
        wrote = PyObject_IsTrue(result);
        Py_DECREF(result);
    }
    if (wrote <= 0) return wrote;
    PyObject *str = text_obj;
    if (str) Py_INCREF(str);
    else if (!(str = PyUnicode_DecodeUTF8(text, len, "replace"))) return -1;
    int failed = PyList_Append(self->texts, str);
    Py_DECREF(str);
    return failed ? -1 : 1;
}

static PyObject *Tap_chunk(Tap *self, PyObject *args) {
    long long n;
    const char *text;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Ls#", &n, &text, &len)) return NULL;
    return tap_chunk(self, n, text, len);
}

/* tap(n, text) -> bool: the TokenSink call (no cursor check: the caller orders events). */
static PyObject *Tap_call(Tap *self, PyObject *args, PyObject *kwds) {
    long long n;
    PyObject *text;
    if (!PyArg_ParseTuple(args, "LU", &n, &text)) return NULL;
    Py_ssize_t len;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &len);
    if (!utf8) return NULL;
    int took = tap_take(self, n, utf8, len, text);
    if (took < 0) return NULL;
    return PyBool_FromLong(took);
}

static PyMethodDef Tap_methods[] = {
    {"chunk", (PyCFunction)Tap_chunk, METH_VARARGS, "chunk(n, text) -> bytes: the SSE event of token n"},
    {NULL}
};

static PyMemberDef Tap_members[] = {
    {"cursor", T_LONGLONG, offsetof(Tap, cursor), 0, "n of the last token this tap took from a dispatcher"},
    {"last", T_DOUBLE, offsetof(Tap, last), 0, "the `now` of the feed() that took it"},
    {"open", T_BOOL, offsetof(Tap, open), 0, "False: decline every token (the Python path writes them)"},
    {"texts", T_OBJECT, offsetof(Tap, texts), READONLY, "the texts of the tokens written"},
    {"transport", T_OBJECT, offsetof(Tap, transport), READONLY, "where it writes HTTP chunks itself, or None"},
    {NULL}
};

static PyTypeObject TapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fairway_live_fast.Tap",
    .tp_basicsize = sizeof(Tap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One waiting stream's fast path: Tap(head, write, texts, open=True)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tap_init,
    .tp_dealloc = (destructor)Tap_dealloc,
    .tp_traverse = (traverseproc)Tap_traverse,
    .tp_clear = (inquiry)Tap_clear,
    .tp_call = (ternaryfunc)Tap_call,
    .tp_methods = Tap_methods,
    .tp_members = Tap_members,
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
    PyObject *taps;         /* dict: channel (str) -> Tap */
    PyObject *error_class;  /* what an error reply becomes */
    Buf pending;            /* bytes of a message not complete yet */
} Dispatcher;

static int Dispatcher_init(Dispatcher *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"taps", "error_class", NULL};
    PyObject *taps, *error_class;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O", names, &PyDict_Type, &taps, &error_class)) return -1;
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
    /* "<n> t<ids>\x1f<text>" */
    const char *end = payload + payload_len, *s = payload;
    long long n = 0;
    while (s < end && *s >= '0' && *s <= '9' && n < (1LL << 50)) n = n * 10 + (*s++ - '0');
    if (s == payload || end - s < 2 || s[0] != ' ' || s[1] != 't') return 0;
    const char *sep = memchr(s + 2, '\x1f', end - s - 2);
    if (!sep) return 0;
    PyObject *key = PyUnicode_DecodeUTF8(channel, channel_len, "strict");
    if (!key) {
        PyErr_Clear();
        return 0;
    }
    PyObject *tap = PyDict_GetItemWithError(self->taps, key);  /* borrowed */
    Py_DECREF(key);
    if (!tap) return PyErr_Occurred() ? -1 : 0;
    if (!PyObject_TypeCheck(tap, &TapType)) return 0;
    Tap *t = (Tap *)tap;
    if (n != t->cursor + 1) return 0;
    Py_INCREF(tap);  /* write() may drop it from the dict */
    int took = tap_take(t, n, sep + 1, end - sep - 1, NULL);
    if (took == 1) {
        t->cursor = n;
        t->last = now;
    } else if (took < 0) {
        /* A write that raised: the Python path takes this message, and the error surfaces in the
           stream's own task, not in every stream of this connection. */
        PyErr_Clear();
        took = 0;
    }
    Py_DECREF(tap);
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
     "feed(data, now) -> list: the messages not taken by a tap, parsed"},
    {NULL}
};

static PyMemberDef Dispatcher_members[] = {
    {"taps", T_OBJECT, offsetof(Dispatcher, taps), READONLY, "channel -> Tap"},
    {NULL}
};

static PyTypeObject DispatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fairway_live_fast.Dispatcher",
    .tp_basicsize = sizeof(Dispatcher),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Dispatcher(taps, error_class): RESP2 Pub/Sub bytes to taps, the rest parsed",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Dispatcher_init,
    .tp_dealloc = (destructor)Dispatcher_dealloc,
    .tp_traverse = (traverseproc)Dispatcher_traverse,
    .tp_clear = (inquiry)Dispatcher_clear,
    .tp_methods = Dispatcher_methods,
    .tp_members = Dispatcher_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fairway_live_fast", "The relay's per-event path in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit_fairway_live_fast(void) {
    if (PyType_Ready(&TapType) < 0 || PyType_Ready(&DispatcherType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&TapType);
    Py_INCREF(&DispatcherType);
    if (PyModule_AddObject(m, "Tap", (PyObject *)&TapType) < 0
        || PyModule_AddObject(m, "Dispatcher", (PyObject *)&DispatcherType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
