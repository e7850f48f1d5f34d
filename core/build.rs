fn main() {
    // A new or edited migration must rebuild the crate that embeds them.
    println!("cargo:rerun-if-changed=../migrations");
}
