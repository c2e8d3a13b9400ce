/* The relay's token sink (relay.TokenSink, `sink(n, text) -> bool`) at the C level.
 *
 * A sink type written in C may carry, as the type attribute FAIRWAY_TOKEN_SINK_ATTR, a capsule
 * named FAIRWAY_TOKEN_SINK holding a FairwayTokenSink: the Pub/Sub dispatcher
 * (fairway/redis_client/csrc/dispatch.c) then hands it each token event through `take`, with the
 * text as the UTF-8 bytes it arrived in, building no Python object per event. Any other sink is
 * called from the dispatcher as sink(n, text).
 *
 * The dispatcher calls; it knows nothing of what the sink does with the event (the gateway's
 * token writer frames it for HTTP). This header is all the two share.
 */
#ifndef FAIRWAY_TOKEN_SINK_H
#define FAIRWAY_TOKEN_SINK_H

#include <Python.h>

#define FAIRWAY_TOKEN_SINK "fairway.token_sink"
#define FAIRWAY_TOKEN_SINK_ATTR "__token_sink__"

typedef struct {
    /* Take token n (text: len bytes of UTF-8): 1 taken, 0 declined (it comes again through the
       subscriber's iterator), -1 with a Python error set (treated as declined). */
    int (*take)(PyObject *sink, long long n, const char *text, Py_ssize_t len);
} FairwayTokenSink;

#endif
