//! The companion image holds one program and no libc: its binary must be a static x86_64 ELF
//! executable (no program interpreter, PT_INTERP).

fn u16_at(data: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(data.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(data.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(data: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(data.get(at..at + 8)?.try_into().ok()?))
}

const PT_INTERP: u32 = 3;
const EM_X86_64: u16 = 62;

/// Ok when `data` is a static x86_64 executable; else why not.
pub fn static_x86_64(data: &[u8]) -> Result<(), String> {
    if data.get(..4) != Some(b"\x7fELF") || data.get(4) != Some(&2) || data.get(5) != Some(&1) {
        return Err("not a 64-bit little-endian ELF".to_string());
    }
    let truncated = || "a truncated ELF header".to_string();
    let e_type = u16_at(data, 16).ok_or_else(truncated)?;
    let e_machine = u16_at(data, 18).ok_or_else(truncated)?;
    if e_machine != EM_X86_64 || !matches!(e_type, 2 | 3) {
        return Err("not an x86_64 executable".to_string());
    }
    let phoff =
        usize::try_from(u64_at(data, 32).ok_or_else(truncated)?).map_err(|_| truncated())?;
    let phentsize = usize::from(u16_at(data, 54).ok_or_else(truncated)?);
    let phnum = usize::from(u16_at(data, 56).ok_or_else(truncated)?);
    for i in 0..phnum {
        let p_type = u32_at(data, phoff + i * phentsize).ok_or_else(truncated)?;
        if p_type == PT_INTERP {
            return Err("dynamically linked (has an interpreter)".to_string());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 header with program headers of the given types.
    fn elf(machine: u16, program_types: &[u32]) -> Vec<u8> {
        let mut d = vec![0u8; 64];
        d[..6].copy_from_slice(b"\x7fELF\x02\x01");
        d[16..18].copy_from_slice(&2u16.to_le_bytes());
        d[18..20].copy_from_slice(&machine.to_le_bytes());
        d[32..40].copy_from_slice(&64u64.to_le_bytes());
        d[54..56].copy_from_slice(&56u16.to_le_bytes());
        d[56..58].copy_from_slice(&(program_types.len() as u16).to_le_bytes());
        for t in program_types {
            let mut ph = vec![0u8; 56];
            ph[..4].copy_from_slice(&t.to_le_bytes());
            d.extend(ph);
        }
        d
    }

    #[test]
    fn static_and_dynamic_executables() {
        assert!(static_x86_64(&elf(62, &[1, 1, 4])).is_ok());
        assert!(
            static_x86_64(&elf(62, &[6, 3, 1]))
                .unwrap_err()
                .contains("dynamically linked")
        );
        assert!(
            static_x86_64(&elf(183, &[1]))
                .unwrap_err()
                .contains("not an x86_64")
        );
        assert!(static_x86_64(b"#!/bin/sh\necho hi\n").is_err());
        let mut cut = elf(62, &[1, 1]);
        cut.truncate(100);
        assert!(static_x86_64(&cut).is_err());
    }
}
