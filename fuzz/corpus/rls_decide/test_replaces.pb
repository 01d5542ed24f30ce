
test-domain

categoryaccount

foof

barbkthomps

foof

bazshady