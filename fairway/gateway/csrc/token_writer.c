/* A streamed reply's token writer in C: token n's SSE event, in an HTTP/1.1 chunk, straight to
 * the response's connection.
 *
 * TokenWriter(template, texts, transport=None, open=True) is the C twin of
 * fairway/gateway/token_writer.py's PyTokenWriter (tests hold the two to the same bytes). Its
 * event for token n is parts[0] + n + parts[1] + <text as a JSON string> + parts[2] + n + parts[3],
 * the parts of a sse.TokenTemplate (cut from the gateway's one rendering of a chunk, so no chunk
 * text is spelled here). Called as writer(n, text), or by the relay's dispatcher through the
 * C-level token sink protocol (fairway/csrc/token_sink.h) with the text's UTF-8 bytes and no
 * Python object built, it writes the event to the transport as one HTTP chunk, only while the
 * writer is open and the transport is open with nothing buffered (so it never reorders bytes, nor
 * writes past flow control: a transport with a backlog declines, and the stream's task sends
 * through the server), and then appends the text to texts (the reply's text so far).
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
    PyObject *parts[PARTS];  /* its parts, bytes */
    PyObject *texts;  /* list of str */
    PyObject *transport;  /* or NULL */
    PyObject *is_closing, *buffered, *write;  /* its bound methods, looked up once */
    int open;
    Buf scratch;
} TokenWriter;

static PyTypeObject TokenWriterType;

static int TokenWriter_init(TokenWriter *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"template", "texts", "transport", "open", NULL};
    PyObject *template, *texts, *transport = Py_None;
    int open = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!|Op", names, &template, &PyList_Type, &texts, &transport,
                                     &open))
        return -1;
    PyObject *parts = PyObject_GetAttrString(template, "parts");
    if (!parts) return -1;
    if (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) != PARTS) {
        Py_DECREF(parts);
        PyErr_SetString(PyExc_TypeError, "a token template has 4 parts");
        return -1;
    }
    for (int i = 0; i < PARTS; i++) {
        PyObject *part = PyTuple_GET_ITEM(parts, i);
        if (!PyBytes_Check(part)) {
            Py_DECREF(parts);
            PyErr_SetString(PyExc_TypeError, "a token template's parts are bytes");
            return -1;
        }
        Py_INCREF(part);
        Py_XSETREF(self->parts[i], part);
    }
    Py_DECREF(parts);
    Py_INCREF(template); Py_XSETREF(self->template, template);
    Py_INCREF(texts); Py_XSETREF(self->texts, texts);
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
    for (int i = 0; i < PARTS; i++) Py_VISIT(self->parts[i]);
    Py_VISIT(self->texts);
    Py_VISIT(self->transport);
    Py_VISIT(self->is_closing);
    Py_VISIT(self->buffered);
    Py_VISIT(self->write);
    return 0;
}

static int TokenWriter_clear(TokenWriter *self) {
    Py_CLEAR(self->template);
    for (int i = 0; i < PARTS; i++) Py_CLEAR(self->parts[i]);
    Py_CLEAR(self->texts);
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
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int put_part(Buf *b, PyObject *part) {
    return buf_put(b, PyBytes_AS_STRING(part), PyBytes_GET_SIZE(part));
}

/* Token n's SSE event in self->scratch from offset `at`; -1 with an error set on failure. */
static int writer_format(TokenWriter *self, Py_ssize_t at, long long n, const char *text, Py_ssize_t len) {
    Buf *b = &self->scratch;
    b->len = at;
    if (put_part(b, self->parts[0]) < 0 || buf_int(b, n) < 0 || put_part(b, self->parts[1]) < 0
        || buf_json_string(b, text, len) < 0 || put_part(b, self->parts[2]) < 0 || buf_int(b, n) < 0
        || put_part(b, self->parts[3]) < 0)
        return -1;
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
    size_t size = (size_t)(self->scratch.len - SIZE_LINE - 2);
    char *start = self->scratch.data + SIZE_LINE;
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

/* Write token n: 1 written (text kept), 0 declined, -1 error. text_obj: the text as str, if the
   caller has it. */
static int writer_take(TokenWriter *self, long long n, const char *text, Py_ssize_t len, PyObject *text_obj) {
    if (!self->open || !self->transport) return 0;
    int wrote = writer_send(self, n, text, len);
    if (wrote <= 0) return wrote;
    PyObject *str = text_obj;
    if (str) Py_INCREF(str);
    else if (!(str = PyUnicode_DecodeUTF8(text, len, "replace"))) return -1;
    int failed = PyList_Append(self->texts, str);
    Py_DECREF(str);
    return failed ? -1 : 1;
}

/* The C-level token sink protocol (token_sink.h): the relay's dispatcher calls this. */
static int sink_take(PyObject *self, long long n, const char *text, Py_ssize_t len) {
    return writer_take((TokenWriter *)self, n, text, len, NULL);
}

static const FairwayTokenSink SINK = {sink_take};

static PyObject *TokenWriter_chunk(TokenWriter *self, PyObject *args) {
    long long n;
    const char *text;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Ls#", &n, &text, &len)) return NULL;
    if (writer_format(self, 0, n, text, len) < 0) return NULL;
    return PyBytes_FromStringAndSize(self->scratch.data, self->scratch.len);
}

/* writer(n, text) -> bool: the relay.TokenSink call (no order check: the caller orders events). */
static PyObject *TokenWriter_call(TokenWriter *self, PyObject *args, PyObject *kwds) {
    long long n;
    PyObject *text;
    if (!PyArg_ParseTuple(args, "LU", &n, &text)) return NULL;
    Py_ssize_t len;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &len);
    if (!utf8) return NULL;
    int took = writer_take(self, n, utf8, len, text);
    if (took < 0) return NULL;
    return PyBool_FromLong(took);
}

static PyMethodDef TokenWriter_methods[] = {
    {"chunk", (PyCFunction)TokenWriter_chunk, METH_VARARGS, "chunk(n, text) -> bytes: the SSE event of token n"},
    {NULL}
};

static PyMemberDef TokenWriter_members[] = {
    {"open", T_BOOL, offsetof(TokenWriter, open), 0, "False: decline every token (the stream's task writes them)"},
    {"template", T_OBJECT, offsetof(TokenWriter, template), READONLY, "the sse.TokenTemplate it fills"},
    {"texts", T_OBJECT, offsetof(TokenWriter, texts), READONLY, "the texts of the tokens written"},
    {"transport", T_OBJECT, offsetof(TokenWriter, transport), READONLY, "where it writes HTTP chunks, or None"},
    {NULL}
};

static PyTypeObject TokenWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fairway_token_writer.TokenWriter",
    .tp_basicsize = sizeof(TokenWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,  /* (final: the sink protocol casts self) */
    .tp_doc = "TokenWriter(template, texts, transport=None, open=True): a stream's token events to its connection",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)TokenWriter_init,
    .tp_dealloc = (destructor)TokenWriter_dealloc,
    .tp_traverse = (traverseproc)TokenWriter_traverse,
    .tp_clear = (inquiry)TokenWriter_clear,
    .tp_call = (ternaryfunc)TokenWriter_call,
    .tp_methods = TokenWriter_methods,
    .tp_members = TokenWriter_members,
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
