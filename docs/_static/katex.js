// Typeset what pymdownx.arithmatex (generic mode) marks: `.arithmatex` elements holding
// \( ... \) inline or \[ ... \] display math. Nothing else on a page is touched, so a `$`
// in prose or code stays as it is. Material's instant navigation swaps page content without
// a reload, so this runs on every `document$` emission.
document$.subscribe(() => {
  for (const element of document.querySelectorAll(".arithmatex")) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  }
});
