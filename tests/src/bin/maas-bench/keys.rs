//! API keys straight into PostgreSQL.

use anyhow::{Context, Result, bail};
use maas_types::apikey;
use std::fmt::Write as _;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// xorshift64*: benchmark keys need to be distinct, not secret.
pub(crate) struct Rng(u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub(crate) fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

pub(crate) fn psql(pg_bin: &Path, db_url: &str, sql: &str, stdin: Option<&[u8]>) -> Result<String> {
    let mut child = Command::new(pg_bin.join("psql"))
        .args([db_url, "-v", "ON_ERROR_STOP=1", "-Atq", "-c", sql])
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run psql")?;
    if let Some(data) = stdin {
        let mut pipe = child.stdin.take().context("psql stdin")?;
        pipe.write_all(data)?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("psql {sql:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Inserts `n` active keys (key `i` of user `username(i)`) with the stored hash
/// (`maas_types::apikey`), and writes their plaintexts, one per fixed-width line, to `keys_file`.
pub(crate) fn insert_keys(
    pg_bin: &Path,
    db_url: &str,
    n: usize,
    keys_file: &Path,
    username: &dyn Fn(usize) -> String,
) -> Result<()> {
    // The companion creates the table at start (it may still be migrating).
    let deadline = Instant::now() + Duration::from_secs(60);
    while psql(pg_bin, db_url, "SELECT 1 FROM api_keys LIMIT 1", None).is_err() {
        if Instant::now() > deadline {
            bail!("table api_keys never appeared");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let expires = psql(
        pg_bin,
        db_url,
        "SELECT to_char((now() + interval '30 days') AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') || '+00'",
        None,
    )?;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64
        ^ (u64::from(std::process::id()) << 32)
        | 1;
    let mut rng = Rng(seed);
    let mut rows = String::with_capacity(n * 200);
    let mut plain = String::with_capacity(n * (apikey::KEY_LEN + 1));
    for i in 0..n {
        let mut id = [0u8; apikey::KEY_ID_BYTES];
        let mut secret = [0u8; apikey::SECRET_BYTES];
        rng.fill(&mut id);
        rng.fill(&mut secret);
        let (key_id, key) = apikey::format_key(&id, &secret);
        let parts = apikey::parse(&key).map_err(|e| anyhow::anyhow!("generated key: {e}"))?;
        let hash = apikey::hash(parts);
        let mut u = [0u8; 16];
        rng.fill(&mut u);
        let h = hex(&u);
        let uuid = format!(
            "{}-{}-4{}-a{}-{}",
            &h[0..8],
            &h[8..12],
            &h[13..16],
            &h[17..20],
            &h[20..32]
        );
        let _ = writeln!(
            rows,
            "{uuid}\t{key_id}\t{hash}\t{}\tbench-{i}\t\\N\t{{system:authenticated,tier-bench-users}}\t{expires}",
            username(i)
        );
        plain.push_str(&key);
        plain.push('\n');
    }
    psql(
        pg_bin,
        db_url,
        "COPY api_keys (id, key_id, key_hash, username, name, tier, user_groups, expires_at) FROM STDIN",
        Some(rows.as_bytes()),
    )?;
    std::fs::write(keys_file, plain)?;
    Ok(())
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
