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
 * The system's libnghttp2 comes without its header here: bench/nghttp2_api.h declares what this
 * uses.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include "nghttp2_api.h"

#define WINDOW (16 << 20)
#define MAX_MESSAGE (256u << 20)

typedef struct Chunk {
    struct Chunk *next;
    size_t len, sent;
    uint8_t data[];
} Chunk;

typedef struct {
    int32_t id;
    int known_method; /* :path is the echo's Stream or Unary */
    int responded;    /* its response headers are submitted */
    int client_done;  /* the client half-closed */
    uint8_t *in;      /* the request bytes not yet made into messages */
    size_t in_len, in_cap;
    Chunk *out_head, *out_tail; /* reply messages (with their 5-byte prefixes) not yet sent */
} Stream;

typedef struct {
    int fd;
    nghttp2_session *session;
    uint8_t *pending; /* bytes nghttp2 gave us that the socket did not take yet */
    size_t pending_len, pending_off;
} Conn;

static nghttp2_nv nv(const char *name, const char *value) {
    return (nghttp2_nv){(uint8_t *)name, (uint8_t *)value, strlen(name), strlen(value), 0};
}

static void push_reply(Stream *s, const uint8_t *msg, size_t len) {
    uint32_t size = 0;
    if (len >= 4) memcpy(&size, msg, 4); /* little-endian host: gdn_client._echo's header */
    size_t payload = len >= 4 ? len - 4 : 0, take = payload < size ? payload : size;
    Chunk *c = malloc(sizeof(Chunk) + 5 + (size_t)size);
    if (c == NULL) abort();
    c->next = NULL;
    c->len = 5 + (size_t)size;
    c->sent = 0;
    c->data[0] = 0; /* not compressed */
    uint32_t be = htonl(size);
    memcpy(c->data + 1, &be, 4);
    memcpy(c->data + 5, msg + 4, take);
    memset(c->data + 5 + take, 0, size - take);
    if (s->out_tail) s->out_tail->next = c;
    else s->out_head = c;
    s->out_tail = c;
}

static ssize_t read_reply(nghttp2_session *session, int32_t id, uint8_t *buf, size_t length, uint32_t *flags,
                          nghttp2_data_source *source, void *user) {
    Stream *s = source->ptr;
    size_t n = 0;
    while (s->out_head != NULL && n < length) {
        Chunk *c = s->out_head;
        size_t take = c->len - c->sent < length - n ? c->len - c->sent : length - n;
        memcpy(buf + n, c->data + c->sent, take);
        c->sent += take;
        n += take;
        if (c->sent == c->len) {
            s->out_head = c->next;
            if (s->out_head == NULL) s->out_tail = NULL;
            free(c);
        }
    }
    if (n > 0) return (ssize_t)n;
    if (!s->client_done) return ERR_DEFERRED;
    *flags |= DATA_FLAG_EOF | DATA_FLAG_NO_END_STREAM;
    nghttp2_nv trailer = nv("grpc-status", "0");
    nghttp2_submit_trailer(session, id, &trailer, 1);
    return 0;
}

static int on_begin_headers(nghttp2_session *session, const nghttp2_frame *frame, void *user) {
    if (frame->hd.type != FRAME_HEADERS || nghttp2_session_get_stream_user_data(session, frame->hd.stream_id))
        return 0;
    Stream *s = calloc(1, sizeof(Stream));
    if (s == NULL) abort();
    s->id = frame->hd.stream_id;
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
            nghttp2_nv h[] = {nv(":status", "200"), nv("content-type", "application/grpc"), nv("grpc-status", "12")};
            nghttp2_submit_response(session, s->id, h, 3, NULL);
            s->client_done = 1;
            return 0;
        }
        nghttp2_nv h[] = {nv(":status", "200"), nv("content-type", "application/grpc")};
        nghttp2_data_provider provider = {{.ptr = s}, read_reply};
        nghttp2_submit_response(session, s->id, h, 2, &provider);
    }
    if ((frame->hd.type == FRAME_DATA || frame->hd.type == FRAME_HEADERS) && (frame->hd.flags & FLAG_END_STREAM)) {
        s->client_done = 1;
        nghttp2_session_resume_data(session, s->id);
    }
    return 0;
}

static int on_data_chunk(nghttp2_session *session, uint8_t flags, int32_t id, const uint8_t *data, size_t len,
                         void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, id);
    if (s == NULL || !s->known_method) return 0;
    if (s->in_len + len > s->in_cap) {
        size_t cap = s->in_cap < 65536 ? 65536 : s->in_cap;
        while (cap < s->in_len + len) cap *= 2;
        uint8_t *grown = realloc(s->in, cap);
        if (grown == NULL) abort();
        s->in = grown;
        s->in_cap = cap;
    }
    memcpy(s->in + s->in_len, data, len);
    s->in_len += len;
    size_t at = 0;
    int replied = 0;
    while (s->in_len - at >= 5) {
        uint32_t be;
        memcpy(&be, s->in + at + 1, 4);
        size_t size = ntohl(be);
        if (s->in[at] != 0 || size > MAX_MESSAGE) return ERR_CALLBACK_FAILURE; /* drop the connection */
        if (s->in_len - at - 5 < size) break;
        push_reply(s, s->in + at + 5, size);
        at += 5 + size;
        replied = 1;
    }
    memmove(s->in, s->in + at, s->in_len - at);
    s->in_len -= at;
    if (replied) nghttp2_session_resume_data(session, id);
    return 0;
}

static int on_stream_close(nghttp2_session *session, int32_t id, uint32_t error_code, void *user) {
    Stream *s = nghttp2_session_get_stream_user_data(session, id);
    if (s == NULL) return 0;
    while (s->out_head) {
        Chunk *c = s->out_head;
        s->out_head = c->next;
        free(c);
    }
    free(s->in);
    free(s);
    return 0;
}

static nghttp2_session_callbacks *callbacks;

/* Writes what nghttp2 has to send; 0 while the connection lives, -1 once it is done or broken. */
static int flush(Conn *c, int epfd) {
    for (;;) {
        if (c->pending_off == c->pending_len) {
            const uint8_t *data;
            ssize_t n = nghttp2_session_mem_send(c->session, &data);
            if (n < 0) return -1;
            if (n == 0) break;
            /* nghttp2's buffer is good until the next mem_send: try it straight */
            ssize_t w = send(c->fd, data, (size_t)n, MSG_NOSIGNAL);
            if (w == n) continue;
            if (w < 0 && errno != EAGAIN) return -1;
            size_t done = w > 0 ? (size_t)w : 0;
            c->pending = realloc(c->pending, (size_t)n - done);
            if (c->pending == NULL) abort();
            memcpy(c->pending, data + done, (size_t)n - done);
            c->pending_len = (size_t)n - done;
            c->pending_off = 0;
        }
        ssize_t w = send(c->fd, c->pending + c->pending_off, c->pending_len - c->pending_off, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno != EAGAIN) return -1;
            struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = c};
            epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
            return 0;
        }
        c->pending_off += (size_t)w;
        if (c->pending_off < c->pending_len) continue;
        c->pending_off = c->pending_len = 0;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
    return nghttp2_session_want_read(c->session) || nghttp2_session_want_write(c->session) ? 0 : -1;
}

static void close_conn(Conn *c, int epfd) {
    epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    nghttp2_session_del(c->session); /* closes its streams: on_stream_close frees them */
    free(c->pending);
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
                int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd < 0) continue;
                int one = 1;
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                Conn *c = calloc(1, sizeof(Conn));
                if (c == NULL) abort();
                c->fd = fd;
                nghttp2_session_server_new(&c->session, callbacks, c);
                nghttp2_settings_entry settings[] = {{SETTINGS_MAX_CONCURRENT_STREAMS, 1000},
                                                     {SETTINGS_INITIAL_WINDOW_SIZE, WINDOW}};
                nghttp2_submit_settings(c->session, 0, settings, 2);
                nghttp2_session_set_local_window_size(c->session, 0, 0, WINDOW); /* the connection's */
                struct epoll_event cev = {.events = EPOLLIN, .data.ptr = c};
                epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &cev);
                if (flush(c, epfd) < 0) close_conn(c, epfd);
                continue;
            }
            Conn *c = events[i].data.ptr;
            int broken = 0;
            if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                for (;;) {
                    ssize_t r = recv(c->fd, buf, sizeof buf, 0);
                    if (r == 0 || (r < 0 && errno != EAGAIN)) {
                        broken = 1;
                        break;
                    }
                    if (r < 0) break;
                    if (nghttp2_session_mem_recv(c->session, buf, (size_t)r) < 0) {
                        broken = 1;
                        break;
                    }
                    if ((size_t)r < sizeof buf) break;
                }
            }
            if (broken || flush(c, epfd) < 0) close_conn(c, epfd);
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    int port = argc > 1 ? atoi(argv[1]) : 0, threads = argc > 2 ? atoi(argv[2]) : 1;
    nghttp2_session_callbacks_new(&callbacks);
    nghttp2_session_callbacks_set_on_begin_headers_callback(callbacks, on_begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(callbacks, on_header);
    nghttp2_session_callbacks_set_on_frame_recv_callback(callbacks, on_frame_recv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(callbacks, on_data_chunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(callbacks, on_stream_close);
    listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (bind(listen_fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(listen_fd, 1024) != 0 ||
        getsockname(listen_fd, (struct sockaddr *)&addr, &len) != 0) {
        perror("h2_floor");
        return 2;
    }
    printf("listening on 127.0.0.1:%d\n", ntohs(addr.sin_port));
    fflush(stdout);
    pthread_t tid;
    for (int i = 1; i < threads; i++) pthread_create(&tid, NULL, serve, NULL);
    serve(NULL);
    return 0;
}
