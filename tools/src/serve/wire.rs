//! HTTP/1.1 framing for `deltafin serve` over plain `TcpStream`s: request heads parsed by
//! `httparse` under size and time limits, bodies read only up to a cap, keep-alive and
//! pipelining, `Expect: 100-continue`, fixed-length replies and chunk-encoded event streams,
//! and a check for a client that has gone away.
//!
//! Why not an HTTP server crate: the small synchronous ones allocate the declared
//! `Content-Length` when they discard an unread body, so one request claiming a terabyte
//! aborts the server. Here nothing a client declares is allocated before it is checked.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Largest request head (request line and headers).
pub(crate) const MAX_HEAD_BYTES: usize = 64 << 10;
/// Most headers in a request.
const MAX_HEADERS: usize = 64;
/// Time to send a request head or body once started.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Time an idle keep-alive connection waits for its next request.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// One parsed request.
#[derive(Debug)]
pub(crate) struct HttpRequest {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor: u8,
    pub body: Vec<u8>,
    /// The client wants the connection kept open after the reply.
    pub keep_alive: bool,
}

/// Why no request could be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The connection closed (or idled out) between requests: nothing to answer.
    Closed,
    /// A request that gets this status and message, then the connection closes.
    Refuse(u16, String),
}

/// A client connection: the stream and bytes read past the last request (pipelining).
#[derive(Debug)]
pub(crate) struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub(crate) fn new(stream: TcpStream) -> Conn {
        let _ = stream.set_nodelay(true);
        Conn {
            stream,
            buf: Vec::new(),
        }
    }

    /// Read the next request, its body at most `max_body` bytes.
    pub(crate) fn read_request(&mut self, max_body: usize) -> Result<HttpRequest, ReadError> {
        let _ = self.stream.set_read_timeout(Some(IDLE_TIMEOUT));
        let head_len = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i + 4;
            }
            if self.buf.len() > MAX_HEAD_BYTES {
                return Err(ReadError::Refuse(
                    431,
                    "the request head is too large".into(),
                ));
            }
            let started = !self.buf.is_empty();
            match self.fill() {
                Ok(0) if !started => return Err(ReadError::Closed),
                Ok(0) => {
                    return Err(ReadError::Refuse(
                        400,
                        "the request head is incomplete".into(),
                    ))
                }
                Ok(_) => {}
                Err(_) if !started => return Err(ReadError::Closed),
                Err(_) => return Err(ReadError::Refuse(408, "the request head timed out".into())),
            }
            let _ = self.stream.set_read_timeout(Some(REQUEST_TIMEOUT));
        };
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Request::new(&mut headers);
        match parsed.parse(&self.buf[..head_len]) {
            Ok(httparse::Status::Complete(_)) => {}
            Ok(httparse::Status::Partial) => {
                return Err(ReadError::Refuse(
                    400,
                    "the request head is incomplete".into(),
                ))
            }
            Err(httparse::Error::TooManyHeaders) => {
                return Err(ReadError::Refuse(
                    431,
                    format!("more than {MAX_HEADERS} headers"),
                ))
            }
            Err(e) => return Err(ReadError::Refuse(400, format!("malformed request: {e}"))),
        }
        let method = parsed.method.unwrap_or("").to_string();
        let target = parsed.path.unwrap_or("");
        let path = target.split('?').next().unwrap_or("").to_string();
        let minor = parsed.version.unwrap_or(1);
        let header = |name: &str| {
            parsed
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| String::from_utf8_lossy(h.value).trim().to_ascii_lowercase())
        };
        let connection = header("connection").unwrap_or_default();
        let keep_alive = if minor == 0 {
            connection.contains("keep-alive")
        } else {
            !connection.contains("close")
        };
        if header("transfer-encoding").is_some() {
            return Err(ReadError::Refuse(
                411,
                "chunked request bodies are not accepted; send Content-Length".into(),
            ));
        }
        let length = match header("content-length") {
            None => 0,
            Some(v) => v.parse::<u64>().map_err(|_| {
                ReadError::Refuse(400, format!("Content-Length `{v}` is not a number"))
            })?,
        };
        if length > max_body as u64 {
            // A body a few times the cap is read and dropped, so the client (still sending)
            // sees the refusal; a larger one is not waited for.
            if length <= 8 * max_body as u64 {
                let mut left = (length as usize).saturating_sub(self.buf.len() - head_len);
                self.buf.clear();
                while left > 0 {
                    match self.fill() {
                        Ok(0) | Err(_) => break,
                        Ok(n) => left = left.saturating_sub(n),
                    }
                    self.buf.clear();
                }
            }
            return Err(ReadError::Refuse(
                413,
                format!("the request body is {length} bytes; at most {max_body} are accepted"),
            ));
        }
        let length = length as usize; // at most max_body
        if header("expect").is_some_and(|e| e == "100-continue")
            && self.buf.len() < head_len + length
        {
            self.stream
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .map_err(|_| ReadError::Closed)?;
        }
        while self.buf.len() < head_len + length {
            match self.fill() {
                Ok(0) | Err(_) => {
                    return Err(ReadError::Refuse(
                        400,
                        "the request body ended early".into(),
                    ))
                }
                Ok(_) => {}
            }
        }
        let body = self.buf[head_len..head_len + length].to_vec();
        self.buf.drain(..head_len + length);
        Ok(HttpRequest {
            method,
            path,
            minor,
            body,
            keep_alive,
        })
    }

    /// Read more bytes into the buffer.
    fn fill(&mut self) -> io::Result<usize> {
        let mut chunk = [0u8; 16 << 10];
        let n = self.stream.read(&mut chunk)?;
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    /// A complete reply.
    pub(crate) fn respond(
        &mut self,
        status: u16,
        content_type: &str,
        extra: &[(&str, String)],
        body: &[u8],
        keep_alive: bool,
    ) -> io::Result<()> {
        let mut head = format!(
            "HTTP/1.1 {status} {}\r\nServer: deltafin\r\nContent-Type: {content_type}\r\n\
             Content-Length: {}\r\nConnection: {}\r\n",
            reason(status),
            body.len(),
            if keep_alive { "keep-alive" } else { "close" }
        );
        for (k, v) in extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        self.stream.write_all(head.as_bytes())?;
        self.stream.write_all(body)?;
        self.stream.flush()
    }

    /// Start a `text/event-stream` reply: chunk-encoded on HTTP/1.1 (the connection stays
    /// usable), until the connection closes on HTTP/1.0.
    pub(crate) fn start_events(&mut self, minor: u8) -> io::Result<EventStream<'_>> {
        let chunked = minor >= 1;
        let head = if chunked {
            "HTTP/1.1 200 OK\r\nServer: deltafin\r\nContent-Type: text/event-stream\r\n\
             Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        } else {
            "HTTP/1.0 200 OK\r\nServer: deltafin\r\nContent-Type: text/event-stream\r\n\
             Cache-Control: no-cache\r\nConnection: close\r\n\r\n"
        };
        self.stream.write_all(head.as_bytes())?;
        self.stream.flush()?;
        Ok(EventStream {
            conn: self,
            chunked,
        })
    }

    /// Close after a refusal without losing the reply: stop writing, then read and discard
    /// what the client is still sending for a moment (closing with unread bytes would reset
    /// the connection and the client might never see the reply).
    pub(crate) fn linger(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        let _ = self
            .stream
            .set_read_timeout(Some(Duration::from_millis(500)));
        let mut sink = [0u8; 16 << 10];
        let mut left: usize = 8 << 20;
        while left > 0 {
            match self.stream.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    }

    /// True when the client has closed its side or the connection broke (checked without
    /// blocking; bytes of a pipelined next request do not count as gone).
    pub(crate) fn client_gone(&mut self) -> bool {
        if self.stream.set_nonblocking(true).is_err() {
            return true;
        }
        let mut probe = [0u8; 1];
        let gone = match self.stream.peek(&mut probe) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() != io::ErrorKind::WouldBlock,
        };
        let _ = self.stream.set_nonblocking(false);
        gone
    }
}

/// A server-sent-event reply in progress; every event is flushed as it is written.
#[derive(Debug)]
pub(crate) struct EventStream<'c> {
    conn: &'c mut Conn,
    chunked: bool,
}

impl EventStream<'_> {
    /// One `data:` event.
    pub(crate) fn data(&mut self, payload: &str) -> io::Result<()> {
        let event = format!("data: {payload}\n\n");
        let s = &mut self.conn.stream;
        if self.chunked {
            s.write_all(format!("{:x}\r\n", event.len()).as_bytes())?;
            s.write_all(event.as_bytes())?;
            s.write_all(b"\r\n")?;
        } else {
            s.write_all(event.as_bytes())?;
        }
        s.flush()
    }

    /// The end of the reply.
    pub(crate) fn finish(self) -> io::Result<()> {
        if self.chunked {
            self.conn.stream.write_all(b"0\r\n\r\n")?;
        }
        self.conn.stream.flush()
    }

    pub(crate) fn client_gone(&mut self) -> bool {
        self.conn.client_gone()
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Payload Too Large",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A connection whose client side writes `raw` (then closes when `close`).
    fn conn_with(raw: &'static [u8], close: bool) -> (Conn, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut client = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (server, _) = l.accept().expect("accept");
        client.write_all(raw).expect("write");
        if close {
            client
                .shutdown(std::net::Shutdown::Write)
                .expect("shutdown");
        }
        (Conn::new(server), client)
    }

    #[test]
    fn reads_pipelined_requests_with_bodies() {
        let (mut c, _client) = conn_with(
            b"POST /v1/x?y=1 HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloGET /health HTTP/1.0\r\n\r\n",
            true,
        );
        let a = c.read_request(100).expect("first");
        assert_eq!(
            (a.method.as_str(), a.path.as_str(), a.body.as_slice()),
            ("POST", "/v1/x", &b"hello"[..])
        );
        assert!(a.keep_alive);
        let b = c.read_request(100).expect("second");
        assert_eq!(
            (b.path.as_str(), b.minor, b.keep_alive),
            ("/health", 0, false)
        );
        assert!(matches!(c.read_request(100), Err(ReadError::Closed)));
    }

    #[test]
    fn a_huge_declared_body_is_refused_without_allocating_it() {
        let (mut c, _client) = conn_with(
            b"POST / HTTP/1.1\r\nContent-Length: 1000000000000000\r\n\r\n{}",
            false,
        );
        assert!(matches!(
            c.read_request(1 << 20),
            Err(ReadError::Refuse(413, _))
        ));
        let (mut c, _client) = conn_with(
            b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
            false,
        );
        assert!(matches!(
            c.read_request(1 << 20),
            Err(ReadError::Refuse(400, _))
        ));
    }

    #[test]
    fn malformed_and_truncated_heads_are_refused() {
        let (mut c, _client) = conn_with(b"\x00\x01garbage\r\n\r\n", true);
        assert!(matches!(
            c.read_request(100),
            Err(ReadError::Refuse(400, _))
        ));
        let (mut c, _client) = conn_with(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc", true);
        assert!(matches!(
            c.read_request(100),
            Err(ReadError::Refuse(400, _))
        ));
        let (mut c, _client) = conn_with(b"GET / HTTP/1.1\r\nHost: x", true);
        assert!(matches!(
            c.read_request(100),
            Err(ReadError::Refuse(400, _))
        ));
        let (mut c, _client) = conn_with(
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            true,
        );
        assert!(matches!(
            c.read_request(100),
            Err(ReadError::Refuse(411, _))
        ));
    }

    #[test]
    fn sees_a_client_that_went_away() {
        let (mut c, client) = conn_with(b"", false);
        assert!(!c.client_gone());
        drop(client);
        std::thread::sleep(Duration::from_millis(50));
        assert!(c.client_gone());
    }
}
