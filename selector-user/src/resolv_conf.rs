//! The stub resolver's nameservers as a replica group. Every process on a
//! host resolves names through the first `nameserver` of /etc/resolv.conf
//! (glibc asks the others only after a timeout, and sends A and AAAA queries
//! in parallel on one connected socket), so the nameservers are a replica
//! group whose primary is the first: `selector run --resolv-conf` steers
//! lookups away from a stalled first nameserver, for every program at once.

use std::net::{IpAddr, SocketAddr};

/// The DNS port nameservers listen on.
const DNS_PORT: u16 = 53;

/// The nameservers of a resolv.conf that form the group, in order, and
/// the lines naming nameservers it could not use. A group is one address
/// family, that of the first nameserver (the primary every lookup goes
/// to): nameservers of the other family, and lines that are not an
/// address (a link-local one with a `%zone`, junk), are skipped.
pub fn nameservers(text: &str) -> (Vec<SocketAddr>, Vec<String>) {
    let mut servers: Vec<SocketAddr> = Vec::new();
    let mut skipped = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        match words.next().map(str::parse::<IpAddr>) {
            Some(Ok(ip)) if servers.first().is_none_or(|s| s.is_ipv4() == ip.is_ipv4()) => {
                servers.push(SocketAddr::new(ip, DNS_PORT))
            }
            _ => skipped.push(line.trim().to_string()),
        }
    }
    (servers, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nameservers_in_order_with_ipv6_and_junk_skipped() {
        let text = "# generated\nsearch example.test\nnameserver 10.0.0.53\n\
                    nameserver fd00::53\n  nameserver   10.0.1.53  # second\n\
                    options timeout:1\nnameserver bogus\n";
        let (servers, skipped) = nameservers(text);
        assert_eq!(
            servers,
            vec![
                "10.0.0.53:53".parse().unwrap(),
                "10.0.1.53:53".parse().unwrap()
            ]
        );
        assert_eq!(skipped, vec!["nameserver fd00::53", "nameserver bogus"]);
        assert_eq!(nameservers("search x\n"), (vec![], vec![]));
    }

    #[test]
    fn an_ipv6_first_nameserver_makes_an_ipv6_group() {
        let text = "nameserver fd00::53\nnameserver 10.0.0.53\nnameserver fd00::54\n\
                    nameserver fe80::1%eth0\n";
        let (servers, skipped) = nameservers(text);
        assert_eq!(
            servers,
            vec![
                "[fd00::53]:53".parse().unwrap(),
                "[fd00::54]:53".parse().unwrap()
            ]
        );
        assert_eq!(
            skipped,
            vec!["nameserver 10.0.0.53", "nameserver fe80::1%eth0"]
        );
    }
}
