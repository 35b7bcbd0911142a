//! `#[derive(Fingerprint)]` for `bulkhead-fingerprint`: every field in declaration order,
//! enums by variant index then fields, so a field added later is part of the fingerprint
//! without a change anywhere else. A field says how it counts with one attribute:
//!
//! - `#[fingerprint(skip)]`: not state (counters, error text, bytes a checksum stands for);
//! - `#[fingerprint(clock)]`: a time, dead once the role can tick no more;
//! - `#[fingerprint(turn)]`: a round-robin position, dead once every request is submitted;
//! - `#[fingerprint(manifest)]`: a manifest digest held as a bare `u64`, renamed in order
//!   of first appearance like [`Manifest`](../bulkhead_kv/struct.Manifest.html).

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::{format_ident, quote};
use syn::{Data, DeriveInput, Fields, GenericParam, parse_macro_input, parse_quote};

/// Implements `bulkhead_fingerprint::Fingerprint` field by field (see the crate docs).
#[proc_macro_derive(Fingerprint, attributes(fingerprint))]
pub fn derive(input: TokenStream) -> TokenStream {
    let mut input = parse_macro_input!(input as DeriveInput);
    for p in &mut input.generics.params {
        if let GenericParam::Type(t) = p {
            t.bounds.push(parse_quote!(::bulkhead_fingerprint::Fingerprint));
        }
    }
    let body = match &input.data {
        Data::Struct(s) => match fields(&s.fields) {
            Ok((pattern, writes)) => quote! { let Self #pattern = self; #writes },
            Err(e) => return e.to_compile_error().into(),
        },
        Data::Enum(e) => {
            let mut arms = Vec::new();
            for (i, v) in e.variants.iter().enumerate() {
                let name = &v.ident;
                let index = u32::try_from(i).unwrap_or(u32::MAX);
                match fields(&v.fields) {
                    Ok((pattern, writes)) => arms.push(quote! { Self::#name #pattern => { h.tag(#index); #writes } }),
                    Err(e) => return e.to_compile_error().into(),
                }
            }
            quote! { match self { #(#arms)* } }
        }
        Data::Union(u) => {
            return syn::Error::new(u.union_token.span, "Fingerprint is derived for structs and enums only").to_compile_error().into();
        }
    };
    let name = &input.ident;
    let (generics, ty, bounds) = input.generics.split_for_impl();
    quote! {
        impl #generics ::bulkhead_fingerprint::Fingerprint for #name #ty #bounds {
            #[allow(unused_variables)]
            fn fingerprint(&self, h: &mut ::bulkhead_fingerprint::Fingerprinter) { #body }
        }
    }
    .into()
}

/// How one field counts (see the crate docs).
enum Mode {
    Plain,
    Skip,
    Clock,
    Turn,
    Manifest,
}

fn mode(field: &syn::Field) -> syn::Result<Mode> {
    let mut mode = Mode::Plain;
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("fingerprint")) {
        attr.parse_nested_meta(|m| {
            mode = match m.path.get_ident().map(ToString::to_string).as_deref() {
                Some("skip") => Mode::Skip,
                Some("clock") => Mode::Clock,
                Some("turn") => Mode::Turn,
                Some("manifest") => Mode::Manifest,
                _ => return Err(m.error("expected skip, clock, turn or manifest")),
            };
            Ok(())
        })?;
    }
    Ok(mode)
}

/// The destructuring pattern of `fields` and the writes of the fields it binds.
fn fields(fields: &Fields) -> syn::Result<(Tokens, Tokens)> {
    let mut binds = Vec::new();
    let mut writes = Vec::new();
    for (i, f) in fields.iter().enumerate() {
        let var = format_ident!("f{i}");
        let write = match mode(f)? {
            Mode::Plain => quote! { ::bulkhead_fingerprint::Fingerprint::fingerprint(#var, h); },
            Mode::Skip => quote! { let _ = #var; },
            Mode::Clock => quote! { h.clock(|h| ::bulkhead_fingerprint::Fingerprint::fingerprint(#var, h)); },
            Mode::Turn => quote! { h.turn(|h| ::bulkhead_fingerprint::Fingerprint::fingerprint(#var, h)); },
            Mode::Manifest => quote! { h.manifest(*#var); },
        };
        binds.push((f.ident.clone(), var));
        writes.push(write);
    }
    let pattern = match fields {
        Fields::Named(_) => {
            let b = binds.iter().map(|(name, var)| quote! { #name: #var });
            quote! { { #(#b),* } }
        }
        Fields::Unnamed(_) => {
            let b = binds.iter().map(|(_, var)| var);
            quote! { ( #(#b),* ) }
        }
        Fields::Unit => quote! {},
    };
    Ok((pattern, quote! { #(#writes)* }))
}
