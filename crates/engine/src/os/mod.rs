//! What differs between operating systems, one module per concern; the rest of the engine calls
//! these and stays portable.

pub mod memory;
