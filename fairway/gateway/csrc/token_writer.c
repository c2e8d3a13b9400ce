/* A streamed reply's token writer in C: token n's SSE event, in an HTTP/1.1 chunk, straight to
 * the response's connection.
 *
 * TokenWriter(template, transport=None, open=True) is the C twin of
 * fairway/gateway/token_writer.py's PyTokenWriter (tests hold the two to the same bytes). Its
 * event for token n is parts[0] + n + parts[1] + <text as a JSON string> + parts[2] + n + parts[3],
 * the parts of a sse.TokenTemplate (cut from the gateway's one rendering of a chunk, so no chunk
 * text is spelled here). Called as writer(n, text), or by the relay's dispatcher through the
 * C-level token sink protocol (fairway/csrc/token_sink.h) with the text's UTF-8 bytes and no
 * Python object built, it writes the event to the transport as one HTTP chunk, only while the
 * writer is open and the transport is open with nothing buffered (so it never reorders bytes, nor
 * writes past flow control: a transport with a backlog declines, and the stream's task sends
 * through the server), and then appends the text's bytes to the reply's text so far, which it keeps
 * as one UTF-8 buffer (add_text() appends what the stream's task sent itself; text() is the whole):
 * no str object and list slot an event, which hundreds of streams' events pay in allocations and
 * cache misses, and a few bytes a token instead of a str's ~50.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#include "buf.h"
#include "token_sink.h"

static int buf_int(Buf *b, long long v) {
    char tmp[24], *p = tmp + sizeof tmp;  /* not snprintf: a visible share of a relayed event's CPU */
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

enum { PARTS = 4 };

typedef struct {
    PyObject_HEAD
    PyObject *template;  /* the sse.TokenTemplate */
    PyObject *transport;  /* or NULL */
    PyObject *is_closing, *buffered, *write;  /* its bound methods, looked up once */
    int open;
    /* The template's parts, copied in, then the event being written: an event reads and writes
       one block, not its own plus four bytes objects of its own (a stream's are cold between
       events, each a cache miss when hundreds of streams take turns). Part i is
       scratch.data[part_at[i] .. part_at[i + 1]); the event starts at part_at[PARTS]. */
    Py_ssize_t part_at[PARTS + 1];
    Buf scratch;
    Buf text;  /* the reply's text so far, UTF-8 */
} TokenWriter;

static PyTypeObject TokenWriterType;

static int TokenWriter_init(TokenWriter *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"template", "transport", "open", NULL};
    PyObject *template, *transport = Py_None;
    int open = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|Op", names, &template, &transport, &open)) return -1;
    PyObject *parts = PyObject_GetAttrString(template, "parts");
    if (!parts) return -1;
    if (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) != PARTS) {
        Py_DECREF(parts);
        PyErr_SetString(PyExc_TypeError, "a token template has 4 parts");
        return -1;
    }
    self->scratch.len = 0;
    for (int i = 0; i < PARTS; i++) {
        PyObject *part = PyTuple_GET_ITEM(parts, i);
        if (!PyBytes_Check(part)) {
            Py_DECREF(parts);
            PyErr_SetString(PyExc_TypeError, "a token template's parts are bytes");
            return -1;
        }
        self->part_at[i] = self->scratch.len;
        if (buf_put(&self->scratch, PyBytes_AS_STRING(part), PyBytes_GET_SIZE(part)) < 0) {
            Py_DECREF(parts);
            return -1;
        }
    }
    self->part_at[PARTS] = self->scratch.len;
    Py_DECREF(parts);
    Py_INCREF(template); Py_XSETREF(self->template, template);
    self->text.len = 0;
    Py_XSETREF(self->transport, transport == Py_None ? NULL : Py_NewRef(transport));
    Py_CLEAR(self->is_closing);
    Py_CLEAR(self->buffered);
    Py_CLEAR(self->write);
    if (self->transport && (!(self->is_closing = PyObject_GetAttrString(transport, "is_closing"))
                            || !(self->buffered = PyObject_GetAttrString(transport, "get_write_buffer_size"))
                            || !(self->write = PyObject_GetAttrString(transport, "write"))))
        return -1;
    self->open = open;
    return 0;
}

static int TokenWriter_traverse(TokenWriter *self, visitproc visit, void *arg) {
    Py_VISIT(self->template);
    Py_VISIT(self->transport);
    Py_VISIT(self->is_closing);
    Py_VISIT(self->buffered);
    Py_VISIT(self->write);
    return 0;
}

static int TokenWriter_clear(TokenWriter *self) {
    Py_CLEAR(self->template);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->is_closing);
    Py_CLEAR(self->buffered);
    Py_CLEAR(self->write);
    return 0;
}

static void TokenWriter_dealloc(TokenWriter *self) {
    PyObject_GC_UnTrack(self);
    TokenWriter_clear(self);
    PyMem_Free(self->scratch.data);
    PyMem_Free(self->text.data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Part i onto the event (room made by writer_format: nothing moves the block meanwhile). */
static void put_part(TokenWriter *self, int i) {
    Buf *b = &self->scratch;
    Py_ssize_t n = self->part_at[i + 1] - self->part_at[i];
    memcpy(b->data + b->len, b->data + self->part_at[i], n);
    b->len += n;
}

/* Token n's SSE event in self->scratch, `at` bytes into its event area; -1 with an error set on
   failure. Room for the whole event (and the HTTP chunk's trailing CRLF) is made first, so the
   parts are copied from the same block without its moving underneath. */
static int writer_format(TokenWriter *self, Py_ssize_t at, long long n, const char *text, Py_ssize_t len) {
    Buf *b = &self->scratch;
    b->len = self->part_at[PARTS] + at;
    if (buf_reserve(b, self->part_at[PARTS] + 2 * 24 + len * 6 + 2 + 2) < 0) return -1;
    /* (the reserve above is all the room these take: they cannot fail) */
    put_part(self, 0);
    buf_int(b, n);
    put_part(self, 1);
    buf_json_string(b, text, len);
    put_part(self, 2);
    buf_int(b, n);
    put_part(self, 3);
    return 0;
}

/* Straight to the transport, as one HTTP/1.1 chunk: 1 written, 0 declined, -1 error. */
static int writer_send(TokenWriter *self, long long n, const char *text, Py_ssize_t len) {
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
    if (writer_format(self, SIZE_LINE, n, text, len) < 0 || buf_put(&self->scratch, "\r\n", 2) < 0) return -1;
    char *start = self->scratch.data + self->part_at[PARTS] + SIZE_LINE;
    size_t size = (size_t)(self->scratch.data + self->scratch.len - 2 - start);
    *--start = '\n';
    *--start = '\r';
    do { *--start = "0123456789abcdef"[size & 15]; size >>= 4; } while (size);
    PyObject *chunk = PyBytes_FromStringAndSize(start, self->scratch.data + self->scratch.len - start);
    if (!chunk) return -1;
    r = PyObject_CallOneArg(self->write, chunk);
    Py_DECREF(chunk);
    if (!r) return -1;
    Py_DECREF(r);
    return 1;
}

/* Write token n: 1 written (text kept), 0 declined, -1 error. */
static int writer_take(TokenWriter *self, long long n, const char *text, Py_ssize_t len) {
    if (!self->open || !self->transport) return 0;
    int wrote = writer_send(self, n, text, len);
    if (wrote <= 0) return wrote;
    return buf_put(&self->text, text, len) < 0 ? -1 : 1;
}

/* The C-level token sink protocol (token_sink.h): the relay's dispatcher calls this. */
static int sink_take(PyObject *self, long long n, const char *text, Py_ssize_t len) {
    return writer_take((TokenWriter *)self, n, text, len);
}

static const FairwayTokenSink SINK = {sink_take};

static PyObject *TokenWriter_chunk(TokenWriter *self, PyObject *args) {
    long long n;
    const char *text;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Ls#", &n, &text, &len)) return NULL;
    if (writer_format(self, 0, n, text, len) < 0) return NULL;
    return PyBytes_FromStringAndSize(self->scratch.data + self->part_at[PARTS],
                                     self->scratch.len - self->part_at[PARTS]);
}

/* writer(n, text) -> bool: the relay.TokenSink call (no order check: the caller orders events). */
static PyObject *TokenWriter_call(TokenWriter *self, PyObject *args, PyObject *kwds) {
    long long n;
    PyObject *text;
    if (!PyArg_ParseTuple(args, "LU", &n, &text)) return NULL;
    Py_ssize_t len;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &len);
    if (!utf8) return NULL;
    int took = writer_take(self, n, utf8, len);
    if (took < 0) return NULL;
    return PyBool_FromLong(took);
}

static PyObject *TokenWriter_add_text(TokenWriter *self, PyObject *text) {
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "add_text takes a str");
        return NULL;
    }
    Py_ssize_t len;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &len);
    if (!utf8 || buf_put(&self->text, utf8, len) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *TokenWriter_text(TokenWriter *self, PyObject *Py_UNUSED(ignored)) {
    return PyUnicode_DecodeUTF8(self->text.data ? self->text.data : "", self->text.len, "replace");
}

/* The text's length in code points, counted when asked (a tool event's offset: rare), not per
   token: every byte but a UTF-8 continuation byte starts one. */
static PyObject *TokenWriter_get_chars(TokenWriter *self, void *Py_UNUSED(closure)) {
    Py_ssize_t chars = 0;
    for (Py_ssize_t i = 0; i < self->text.len; i++) chars += ((unsigned char)self->text.data[i] & 0xC0) != 0x80;
    return PyLong_FromSsize_t(chars);
}

static PyGetSetDef TokenWriter_getset[] = {
    {"chars", (getter)TokenWriter_get_chars, NULL, "the length of text(), in code points", NULL},
    {NULL}
};

static PyMethodDef TokenWriter_methods[] = {
    {"chunk", (PyCFunction)TokenWriter_chunk, METH_VARARGS, "chunk(n, text) -> bytes: the SSE event of token n"},
    {"add_text", (PyCFunction)TokenWriter_add_text, METH_O,
     "add_text(text): a token's text the stream sent itself, onto the reply's text"},
    {"text", (PyCFunction)TokenWriter_text, METH_NOARGS, "text() -> str: the reply's text so far"},
    {NULL}
};

static PyMemberDef TokenWriter_members[] = {
    {"open", T_BOOL, offsetof(TokenWriter, open), 0, "False: decline every token (the stream's task writes them)"},
    {"template", T_OBJECT, offsetof(TokenWriter, template), READONLY, "the sse.TokenTemplate it fills"},
    {"transport", T_OBJECT, offsetof(TokenWriter, transport), READONLY, "where it writes HTTP chunks, or None"},
    {NULL}
};

static PyTypeObject TokenWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fairway_token_writer.TokenWriter",
    .tp_basicsize = sizeof(TokenWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,  /* (final: the sink protocol casts self) */
    .tp_doc = "TokenWriter(template, transport=None, open=True): a stream's token events to its connection",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)TokenWriter_init,
    .tp_dealloc = (destructor)TokenWriter_dealloc,
    .tp_traverse = (traverseproc)TokenWriter_traverse,
    .tp_clear = (inquiry)TokenWriter_clear,
    .tp_call = (ternaryfunc)TokenWriter_call,
    .tp_methods = TokenWriter_methods,
    .tp_members = TokenWriter_members,
    .tp_getset = TokenWriter_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fairway_token_writer", "A streamed reply's token writer in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit_fairway_token_writer(void) {
    if (PyType_Ready(&TokenWriterType) < 0) return NULL;
    /* The sink protocol, as a type attribute (set once, before any instance exists). */
    PyObject *capsule = PyCapsule_New((void *)&SINK, FAIRWAY_TOKEN_SINK, NULL);
    if (!capsule || PyDict_SetItemString(TokenWriterType.tp_dict, FAIRWAY_TOKEN_SINK_ATTR, capsule) < 0) {
        Py_XDECREF(capsule);
        return NULL;
    }
    Py_DECREF(capsule);
    PyType_Modified(&TokenWriterType);
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&TokenWriterType);
    if (PyModule_AddObject(m, "TokenWriter", (PyObject *)&TokenWriterType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
