//! Key-value store with compare-and-swap: proxy-wasm shared data in Envoy (shared by all worker
//! VMs of the plugin), an in-memory map in native tests with the same CAS rules.

/// The value changed since it was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CasMismatch;

pub trait SharedStore {
    /// Value (None when absent) and its CAS token (None when absent).
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value`; with `cas`, only when the value is still the one read with that token.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch>;
}

/// In-memory store with Envoy's CAS semantics (native tests of the decision code).
#[cfg(test)]
#[derive(Debug, Default)]
pub struct MemStore {
    map: std::cell::RefCell<std::collections::HashMap<String, (Vec<u8>, u32)>>,
    next_cas: std::cell::Cell<u32>,
}

#[cfg(test)]
impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.map
            .borrow()
            .values()
            .filter(|(v, _)| !v.is_empty())
            .count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keys ever written, emptied ones included: proxy-wasm shared data has no delete, so this is
    /// what the key space costs Envoy.
    pub fn key_count(&self) -> usize {
        self.map.borrow().len()
    }
}

#[cfg(test)]
impl SharedStore for MemStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.map.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        let mut map = self.map.borrow_mut();
        if let (Some(expected), Some((_, current))) = (cas, map.get(key))
            && expected != *current
        {
            return Err(CasMismatch);
        }
        let next = self.next_cas.get().wrapping_add(1).max(1);
        self.next_cas.set(next);
        map.insert(key.to_string(), (value.to_vec(), next));
        Ok(())
    }
}

/// Reads a little-endian u64 at `at`.
pub(crate) fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let slice = bytes.get(at..at.checked_add(8)?)?;
    let arr: [u8; 8] = slice.try_into().ok()?;
    Some(u64::from_le_bytes(arr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cas_rules() {
        let s = MemStore::new();
        assert_eq!(s.get("a"), (None, None));
        s.set("a", b"1", None).unwrap();
        let (v, cas) = s.get("a");
        assert_eq!(v.as_deref(), Some(&b"1"[..]));
        s.set("a", b"2", cas).unwrap();
        assert_eq!(s.set("a", b"3", cas), Err(CasMismatch));
        assert_eq!(s.get("a").0.as_deref(), Some(&b"2"[..]));
        // Emptied keys are not entries, but they still take a key (no delete in the ABI).
        s.set("b", b"", None).unwrap();
        assert_eq!((s.len(), s.key_count()), (1, 2));
        assert_eq!(read_u64(&7u64.to_le_bytes(), 0), Some(7));
        assert_eq!(read_u64(&[1, 2], 0), None);
    }
}
