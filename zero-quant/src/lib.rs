//! # zero-quant
//!
//! Block int8 (qwZ) and block int4 (qgZ) quantization codecs with fixed, documented layouts and
//! stated error bounds.
//!
//! **May depend on:** half, bytemuck, thiserror. It knows nothing about ranks or communicators.
//!
//! **Status:** being built (see README).
