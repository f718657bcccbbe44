//! The CUDA source of the device kernels and the hash that ties the checked-in PTX to it
//! (always compiled, so CI can check the PTX without NVRTC or a GPU).

/// `kernels.cu`, the source of the CUDA kernels.
#[cfg(test)]
pub(crate) const CUDA_SOURCE: &str = include_str!("cuda/kernels.cu");

/// `kernels.ptx`, compiled from [`CUDA_SOURCE`] by `cargo xtask ptx`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const CUDA_PTX: &str = include_str!("cuda/kernels.ptx");

/// 64-bit FNV-1a.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The first line of `kernels.ptx` for a given source text and the PTX NVRTC made from it (used by
/// `cargo xtask ptx`): a hash of each, so that a stale source and an edited PTX body both show.
#[doc(hidden)]
pub fn cuda_ptx_header(source: &str, ptx: &str) -> String {
    format!(
        "// zero-quant kernels.cu fnv1a64={:016x} ptx fnv1a64={:016x}",
        fnv1a64(source.as_bytes()),
        fnv1a64(ptx.as_bytes())
    )
}

/// `kernels.ptx` split into its header line and the PTX below it.
#[cfg(test)]
fn split_ptx(text: &str) -> (&str, &str) {
    text.split_once('\n').unwrap_or((text, ""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_in_ptx_was_made_from_this_source() {
        let (first, body) = split_ptx(CUDA_PTX);
        assert_eq!(
            first,
            cuda_ptx_header(CUDA_SOURCE, body),
            "zero-quant/src/cuda/kernels.ptx is stale or was edited by hand: \
             run `cargo xtask ptx` (see its --help)"
        );
        // And it is PTX for the documented target, with every kernel the wrapper loads.
        assert!(CUDA_PTX.contains(".target sm_80"));
        for k in [
            "zq_encode_i8_f32",
            "zq_decode_i4_f16",
            "zq_accumulate_i4",
            "zq_check_padding",
        ] {
            assert!(CUDA_PTX.contains(&format!(".entry {k}(")), "{k} missing");
        }
    }

    #[test]
    fn the_hash_sees_every_byte() {
        assert_ne!(cuda_ptx_header("a", "p"), cuda_ptx_header("b", "p"));
        // An edit to the PTX body alone changes the header too.
        assert_ne!(cuda_ptx_header("a", "p"), cuda_ptx_header("a", "q"));
        let (first, body) = split_ptx("// h\n.version 8.0\n");
        assert_eq!((first, body), ("// h", ".version 8.0\n"));
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        // A published FNV-1a 64 test vector.
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
