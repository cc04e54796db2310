//! Stamps the binary with the commit it was built from, so that a benchmark's JSON names the
//! code that ran, not the checkout it was started in (an A/B run starts an older binary from a
//! newer tree). A build with uncommitted changes to tracked files says `+dirty`; outside a git
//! checkout there is no stamp.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git").args(args).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    // A new commit moves HEAD or the branch it names; staging or committing rewrites the index.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        for f in ["HEAD", "index"] {
            println!("cargo:rerun-if-changed={dir}/{f}");
        }
        if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{r}");
        }
    }
    // Edits to the sources rebuild this crate's dependents anyway; the stamp follows the crates.
    println!("cargo:rerun-if-changed=../../crates");
    if let Some(head) = git(&["rev-parse", "--short", "HEAD"]) {
        let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        println!("cargo:rustc-env=DELTAFIN_BUILD_COMMIT={head}{}", if dirty { "+dirty" } else { "" });
    }
}
