//! Socket addresses as people type them on a command line.

use std::net::SocketAddr;

/// `s` as an address and port (`0.0.0.0:9443`, `[::]:9443`); the error says what was wrong
/// and shows the form, for a port alone (`9443`) too.
pub fn parse_socket_addr(s: &str) -> Result<SocketAddr, String> {
    s.trim().parse::<SocketAddr>().map_err(|_| {
        let why = if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            "a port alone is not an address"
        } else {
            "not an address and port"
        };
        format!(
            "{s:?}: {why}; give both, e.g. 0.0.0.0:{port} (every IPv4 address), [::]:{port} (IPv6) \
             or 127.0.0.1:{port}",
            port = s
                .rsplit(':')
                .next()
                .filter(|p| p.parse::<u16>().is_ok())
                .unwrap_or("9443")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_alone_is_refused_with_the_form_to_use() {
        assert_eq!(
            parse_socket_addr("0.0.0.0:9443").unwrap().to_string(),
            "0.0.0.0:9443"
        );
        assert_eq!(parse_socket_addr("[::]:10250").unwrap().port(), 10250);
        let e = parse_socket_addr("9443").unwrap_err();
        assert!(e.contains("a port alone is not an address"), "{e}");
        assert!(e.contains("e.g. 0.0.0.0:9443"), "{e}");
        let e = parse_socket_addr("localhost:8443").unwrap_err();
        assert!(
            e.contains("not an address and port") && e.contains("127.0.0.1:8443"),
            "{e}"
        );
    }
}
