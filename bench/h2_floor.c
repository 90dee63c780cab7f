/* The floor of a native gRPC front end (bench/NOTES.md, twenty-seventh session): gdn_client._echo's
 * bytes echo (service gdn.bench.Echo, methods Stream and Unary; a request is a 4-byte little-endian
 * reply size and a payload, the reply that many bytes of it, zero-padded) served in C over HTTP/2
 * by libnghttp2, with one epoll loop per thread. What a C worker in front of the engine would pay
 * per step for its transport, against the ~150-230 us of CPU that grpc.aio in Python costs.
 *
 *   python bench/h2_floor.py     # builds this, runs both echoes under gdn-loadtest's echo client
 *   gcc -O2 -pthread bench/h2_floor.c -o /tmp/h2_floor -l:libnghttp2.so.14 && /tmp/h2_floor 0 1
 *
 * Arguments: port (0: any free one) and threads. Prints "listening on 127.0.0.1:PORT" once it
 * serves; runs until killed. Not a server for anything else: no TLS, no deadlines, no compression
 * (a compressed message is refused), no limits beyond the message size.
 *
 * The system's libnghttp2 comes without its header here: gdn_server/_nghttp2_api.h declares what this
 * uses; gdn_server/_h2_common.h holds what it shares with the workers' transport (gdn_server/_native_h2.c).
 */
#define _GNU_SOURCE
#include <pthread.h>

#include "../gdn_server/_h2_common.h"

typedef struct Stream {
    Outbox out; /* first: nghttp2's data source points at the stream */
    Inbox in;
    struct Stream *prev, *next; /* the connection's streams */
    int32_t id;
    int known_method; /* :path is the echo's Stream or Unary */
    int responded;    /* its response headers are submitted */
} Stream;

typedef struct {
    Wire wire;
    Stream *streams;
} Conn;

static void free_stream(Conn *c, Stream *s) {
    if (s->prev) s->prev->next = s->next;
    else c->streams = s->next;
    if (s->next) s->next->prev = s->prev;
    outbox_free(&s->out);
    free(s->in.buf);
    free(s);
}

/* gdn_client._echo's answer: a request is a 4-byte little-endian reply size and a payload; the
   reply is that many bytes of it, zero-padded. */
static int echo(void *ctx, const uint8_t *msg, size_t len) {
    Stream *s = ctx;
    uint32_t size = 0;
    if (len >= 4) memcpy(&size, msg, 4); /* a little-endian host */
    size_t payload = len >= 4 ? len - 4 : 0, take = payload < size ? payload : size;
    uint8_t *reply = outbox_message(&s->out, size);
    if (reply == NULL) return -1;
    memcpy(reply, msg + 4, take);
    memset(reply + take, 0, size - take);
    return 0;
}

static int on_begin_headers(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    if (frame->hd.type != FRAME_HEADERS || nghttp2_session_get_stream_user_data(session, frame->hd.stream_id))
        return 0;
    Conn *c = user;
    Stream *s = calloc(1, sizeof(Stream));
    if (s == NULL) return ERR_CALLBACK_FAILURE;
    s->id = frame->hd.stream_id;
    s->next = c->streams;
    if (c->streams) c->streams->prev = s;
    c->streams = s;
    nghttp2_session_set_stream_user_data(session, s->id, s);
    return 0;
}

static int on_header(nghttp2_session *session, const nghttp2_frame *frame, const uint8_t *name, size_t namelen,
                     const uint8_t *value, size_t valuelen, uint8_t flags, void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (s == NULL || namelen != 5 || memcmp(name, ":path", 5) != 0) return 0;
    static const char *const paths[] = {"/gdn.bench.Echo/Stream", "/gdn.bench.Echo/Unary"};
    for (int i = 0; i < 2; i++)
        if (valuelen == strlen(paths[i]) && memcmp(value, paths[i], valuelen) == 0) s->known_method = 1;
    return 0;
}

static int on_frame_recv(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, frame->hd.stream_id);
    if (s == NULL) return 0;
    if (frame->hd.type == FRAME_HEADERS && !s->responded) {
        s->responded = 1;
        if (!s->known_method) { /* headers and UNIMPLEMENTED in one frame */
            nghttp2_nv h[] = {h2_nv(":status", "200"), h2_nv("content-type", "application/grpc"),
                              h2_nv("grpc-status", "12")};
            nghttp2_submit_response(session, s->id, h, 3, NULL);
            s->out.done = 1;
            return 0;
        }
        nghttp2_nv h[] = {h2_nv(":status", "200"), h2_nv("content-type", "application/grpc")};
        nghttp2_data_provider provider = {{.ptr = s}, outbox_read};
        nghttp2_submit_response(session, s->id, h, 2, &provider);
    }
    if ((frame->hd.type == FRAME_DATA || frame->hd.type == FRAME_HEADERS) && (frame->hd.flags & FLAG_END_STREAM)) {
        s->out.done = 1; /* the client half-closed: trailers (status 0) once the replies are out */
        nghttp2_session_resume_data(session, s->id);
    }
    return 0;
}

static int on_data_chunk(nghttp2_session *session, uint8_t flags, int32_t id, const uint8_t *data, size_t len,
                         void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, id);
    if (s == NULL || !s->known_method) return 0;
    Chunk *before = s->out.tail;
    int rc = inbox_add(&s->in, data, len, H2_MAX_MESSAGE, echo, s);
    if (s->out.tail != before) nghttp2_session_resume_data(session, id);
    return rc;
}

static int on_stream_close(nghttp2_session *session, int32_t id, uint32_t error_code, void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, id);
    if (s != NULL) free_stream(user, s);
    return 0;
}

static nghttp2_session_callbacks *callbacks;

static void close_conn(Conn *c, int epfd) {
    epoll_ctl(epfd, EPOLL_CTL_DEL, c->wire.fd, NULL);
    close(c->wire.fd);
    while (c->streams) free_stream(c, c->streams); /* nghttp2_session_del calls no stream callbacks */
    nghttp2_session_del(c->wire.session);
    free(c->wire.pending);
    free(c);
}

static int listen_fd;

static void *serve(void *arg) {
    int epfd = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLEXCLUSIVE, .data.ptr = NULL};
    epoll_ctl(epfd, EPOLL_CTL_ADD, listen_fd, &ev);
    static __thread uint8_t buf[1 << 16];
    struct epoll_event events[64];
    for (;;) {
        int n = epoll_wait(epfd, events, 64, -1);
        for (int i = 0; i < n; i++) {
            if (events[i].data.ptr == NULL) { /* a new connection: this thread's from now on */
                int fd = h2_accept(listen_fd);
                if (fd < 0) continue;
                Conn *c = calloc(1, sizeof(Conn));
                if (c == NULL || nghttp2_session_server_new(&c->wire.session, callbacks, c) != 0) {
                    close(fd);
                    free(c);
                    continue;
                }
                c->wire.fd = fd;
                h2_server_settings(c->wire.session);
                struct epoll_event cev = {.events = EPOLLIN, .data.ptr = c};
                epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &cev);
                if (wire_flush(&c->wire, epfd, c) < 0) close_conn(c, epfd);
                continue;
            }
            Conn *c = events[i].data.ptr;
            int broken = (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) && wire_read(&c->wire, buf, sizeof buf) < 0;
            if (broken || wire_flush(&c->wire, epfd, c) < 0) close_conn(c, epfd);
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    int port = argc > 1 ? atoi(argv[1]) : 0, threads = argc > 2 ? atoi(argv[2]) : 1;
    callbacks = h2_callbacks(on_begin_headers, on_header, on_frame_recv, on_data_chunk, on_stream_close);
    int bound;
    if ((listen_fd = h2_listen_loopback(port, &bound)) < 0) {
        perror("h2_floor");
        return 2;
    }
    printf("listening on 127.0.0.1:%d\n", bound);
    fflush(stdout);
    pthread_t tid;
    for (int i = 1; i < threads; i++) pthread_create(&tid, NULL, serve, NULL);
    serve(NULL);
    return 0;
}
